"""The GPU check's child processes: ``parity_worker`` (bf16 scoring on the device against float64
on the CPU, on the embedded model) and ``nccl_worker`` (one torchrun rank: an all-reduce and
tether's FSDP2 sharding against the unsharded model). ``gpu_check.py --worker`` runs them.
"""

from __future__ import annotations

import os
import time
from typing import Any

# bf16 scoring against float64 (see parity_worker): mean and largest |log p error| per token, and
# the relative error of the summed exact KL.
PARITY_TOLERANCE = {"logprob_mean_abs": 0.1, "logprob_max_abs": 1.0, "kl_sum_rel": 0.1}

PARITY_ROWS, PARITY_NOISE = 8, 0.05  # held-out problems scored; the policy's weight noise (x each matrix's std)


def _parity_batch(tokenizer: Any, rows: int) -> tuple[Any, Any]:
    """``(tokens, mask)``: held-out arithmetic prompts in the chat template, each with a short answer."""
    import torch

    from tether.train.tasks import load_task

    ids = []
    for problem in load_task("arithmetic").eval_set(rows):
        text = tokenizer.apply_chat_template(problem.chat, tokenize=False, add_generation_prompt=True)
        ids.append(tokenizer(text + f"The answer is {problem.answer}.", add_special_tokens=False)["input_ids"])
    tokens = torch.full((len(ids), max(map(len, ids))), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros(tokens.shape, dtype=torch.bool)
    for i, row in enumerate(ids):
        tokens[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), True
    return tokens, mask


def _errors(got: tuple[Any, Any], exact: tuple[Any, Any], where: Any) -> dict:
    import torch

    lp_err = (got[0] - exact[0]).abs()[where]
    kl_exact, kl_got = exact[1][where], got[1][where]
    return {
        "logprob_mean_abs": float(lp_err.mean()), "logprob_p99_abs": float(torch.quantile(lp_err, 0.99)),
        "logprob_max_abs": float(lp_err.max()), "logprob_mean_float64": float(exact[0][where].mean()),
        "kl_sum_rel": float((kl_got.sum() - kl_exact.sum()).abs() / kl_exact.sum()),
        "kl_per_token_max_abs": float((kl_got - kl_exact).abs().max()),
    }


def parity_worker(device: str, model_name: str) -> dict:
    """bf16 scoring on ``device`` against float64 on the CPU, on the same tokens.

    The policy is the model with seeded noise on its decoder matrices, the reference the model
    itself, so the exact KL is not zero. Two float64 baselines: the float32 weights (what bf16
    training is measured against: weight rounding and bf16 compute together) and the same bf16-rounded
    weights (the compute's rounding alone). Tolerance (PARITY_TOLERANCE): bf16 keeps 8 significant
    bits, a relative rounding of 2^-9 per weight and activation, and the residual stream is rounded
    again at each of its 2 x layers additions (60 in the embedded model): hidden states drift by ~1 %,
    logits spread over ~20 nats move by tenths, and log-probs by a few hundredths on average (the
    error of a token's logit and of the log-sum-exp partly cancel), tenths on the worst token. On
    this batch bf16 on a CPU (its matrix products accumulate in float32, as cuBLAS's do) gave a mean
    of 0.055, a largest error of 0.55 nats, a summed-KL error of 4 %, nearly all from the activations'
    rounding (float64 on the bf16 weights: 0.054 / 0.50); the tolerance is twice that: 0.1, 1.0 nats,
    10 %. tether's reductions over the vocabulary run in float32 and add nothing at this scale.
    """
    import copy

    import torch

    from tether.models.scoring import exact_kl_tokens, score_tokens
    from tether.models.loading import load_base

    reference, tokenizer = load_base(model_name, 0, torch.float32)
    policy = copy.deepcopy(reference)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, weight in policy.named_parameters():
            if weight.dim() == 2 and ".layers." in name:
                weight.add_(torch.randn(weight.shape, generator=noise) * weight.std() * PARITY_NOISE)
    tokens, mask = _parity_batch(tokenizer, PARITY_ROWS)
    where = mask.clone()
    where[:, 0] = False  # a row's first token has no prediction

    def score(pol: Any, ref: Any, dev: str) -> tuple[Any, Any]:
        t, m = tokens.to(dev), mask.to(dev)
        with torch.no_grad():
            lp = score_tokens(pol, t, m).log_probs
            kl = exact_kl_tokens(pol, ref, t, m)
        return lp.double().cpu(), kl.double().cpu()

    # Module.to converts in place: float64 first, then the same modules in bf16, then back to float64.
    exact = score(policy.double(), reference.double(), "cpu")
    pol_bf16, ref_bf16 = (m.to(device=device, dtype=torch.bfloat16) for m in (policy, reference))
    start = time.perf_counter()
    got = score(pol_bf16, ref_bf16, device)
    seconds = time.perf_counter() - start
    rounded = score(pol_bf16.to("cpu", torch.float64), ref_bf16.to("cpu", torch.float64), "cpu")
    errors = _errors(got, exact, where)
    return {
        "model": model_name, "device": device, "sequences": int(tokens.shape[0]), "tokens_scored": int(where.sum()),
        "weight_noise": PARITY_NOISE, "kl_per_token_float64": float(exact[1][where].mean()),
        "logprob_mean_float64": float(exact[0][where].mean()), "bf16_scoring_s": seconds,
        "bf16_vs_float64": errors, "bf16_vs_float64_of_bf16_weights": _errors(got, rounded, where),
        "tolerance": PARITY_TOLERANCE,
        "within_tolerance": all(errors[key] <= limit for key, limit in PARITY_TOLERANCE.items()),
    }


def nccl_worker(device_name: str) -> dict:
    """One rank under torchrun: NCCL (gloo on the CPU) all-reduce, then the tiny model sharded by
    tether's FSDP2 code against the same model unsharded: one loss forward and backward each."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tether.models.loading import load_base
    from tether.train.sharding import _shard

    cuda = device_name == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend)
    try:
        world = dist.get_world_size()
        summed = torch.arange(4.0, device=device)
        dist.all_reduce(summed)
        model, _ = load_base("tiny", 0, torch.float32)
        model.to(device)
        sharded = copy.deepcopy(model)
        units = _shard(sharded, init_device_mesh(device.type, (world,)))
        tokens = torch.randint(0, 250, (4, 16), generator=torch.Generator().manual_seed(0)).to(device)
        losses, grads = [], []
        for m in (model, sharded):
            loss = m(input_ids=tokens, labels=tokens).loss
            loss.backward()
            losses.append(float(loss))
            grads.append({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().cpu()
                          for n, p in m.named_parameters() if p.grad is not None})
        shared = sorted(set(grads[0]) & set(grads[1]))
        grad_diff = max(float((grads[0][n] - grads[1][n]).abs().max()) for n in shared)
        grad_scale = max(float(grads[0][n].abs().max()) for n in shared)
        loss_diff = abs(losses[0] - losses[1])
        return {
            "backend": backend, "world_size": world, "device": str(device),
            "all_reduce_ok": bool(torch.equal(summed.cpu(), torch.arange(4.0) * world)), "fsdp_units": len(units),
            "parameters_compared": len(shared), "parameters_total": len(grads[0]), "loss": losses[0],
            "loss_abs_diff": loss_diff, "grad_max_abs_diff": grad_diff, "grad_max_abs": grad_scale,
            "matches_unsharded": bool(len(shared) == len(grads[0]) and loss_diff <= 1e-5 * (1 + abs(losses[0]))
                                      and grad_diff <= 1e-5 * (1 + grad_scale)),
        }
    finally:
        dist.destroy_process_group()
