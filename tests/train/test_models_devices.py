"""``--model`` from the local HF cache, ``--adapter``, ``--dtype``, ``--device`` and
``--gradient-checkpointing`` on the tiny model (CUDA checks skip without a GPU)."""

from __future__ import annotations

import dataclasses

import json
import socket
from pathlib import Path

import pytest
import torch

from tests.train.test_recipe import interrupted_train, tiny_cfg
from tether.models.tiny import byte_tokenizer, tiny_causal_lm
from tether.train import recipe
from tether.train.recipe import (accumulate_gradients, add_advantages, add_reference, build_run, sample, add_rewards,
                                 step_problems, train)
from tether.models.loading import load_base
from tether.train.run import build_models
from tether.train.sharding import resolve_device

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _tiny_base():
    """The model and tokenizer ``--model tiny`` builds with seed 0."""
    tokenizer = byte_tokenizer()
    return tiny_causal_lm(tokenizer, hidden=64, layers=2, seed=0, head_scale=1.0), tokenizer


def _token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


IDS = torch.tensor([[257, 72, 105, 33, 258, 10, 1, 2, 3]])


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tether tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)


# ------------------------------------------------------------------ --model from the HF cache
def test_a_hub_id_in_the_local_cache_loads_without_network(tmp_path, monkeypatch, no_network):
    """A snapshot laid out as huggingface_hub caches it (refs/main -> snapshots/<commit>)."""
    import huggingface_hub.constants

    model, tokenizer = _tiny_base()
    repo = tmp_path / "hub" / "models--tether-test--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    model.save_pretrained(repo / "snapshots" / commit)
    tokenizer.save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    loaded, loaded_tok = load_base("tether-test/tiny", seed=0)
    assert loaded_tok.get_vocab() == tokenizer.get_vocab()
    torch.testing.assert_close(_token_logprobs(loaded, IDS), _token_logprobs(model, IDS), rtol=0, atol=0)
    with pytest.raises(ValueError) as err:
        load_base("tether-test/absent", seed=0)
    text = str(err.value)
    assert "\n" not in text and "not in the Hugging Face cache" in text and "hf download tether-test/absent" in text


def test_a_missing_path_is_not_looked_up_as_a_hub_id(tmp_path, no_network):
    with pytest.raises(ValueError, match="no such directory; check the path"):
        load_base(str(tmp_path / "nothing" / "here"), seed=0)


# ------------------------------------------------------------------ --adapter
def _save_adapter(path: Path):
    """A LoRA adapter with random (non-zero) B factors, so it changes the model's outputs."""
    import peft

    base, _ = _tiny_base()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(path)
    return model


def test_training_continues_a_saved_adapter(tmp_path):
    """The policy starts as the adapter's model (not the base), the reference is that same
    model frozen (KL 0 at the first step), and training moves the adapter's own weights."""
    adapter = _save_adapter(tmp_path / "adapter")
    base, _ = _tiny_base()
    cfg = tiny_cfg(tmp_path / "run", adapter=str(tmp_path / "adapter"), lora_rank=16, steps=2)
    with pytest.warns(UserWarning, match=r"continuing its LoRA \(rank 4, alpha 8"):
        models = build_models(cfg)
    want = _token_logprobs(adapter, IDS)
    assert (want - _token_logprobs(base, IDS)).abs().max() > 1e-2  # the adapter does change the model
    torch.testing.assert_close(_token_logprobs(models.policy, IDS), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(_token_logprobs(models.reference, IDS), want, rtol=0, atol=1e-6)
    assert "adapter" in models.fingerprint
    with pytest.warns(UserWarning):
        train(cfg, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kl_per_seq"] == pytest.approx(0.0, abs=1e-5) and rows[1]["kl_per_seq"] != 0


def test_an_adapter_with_full_fine_tuning_is_refused(tmp_path):
    _save_adapter(tmp_path / "adapter")
    with pytest.raises(ValueError, match="adapter: .* lora_rank=0 asks to train every weight"):
        build_models(tiny_cfg(tmp_path / "run", adapter=str(tmp_path / "adapter"), lora_rank=0))


# ------------------------------------------------------------------ --dtype, --gradient-checkpointing
def _stages(run, record):
    """The reward, reference and advantage stages of step 0 on ``record`` (filled in place)."""
    add_rewards(run, record, step_problems(run, 0), 0)
    add_reference(run, record)
    add_advantages(run, record)


def _step(run, record):
    """One step's (loss, gradients as float64) on ``record`` (its stages filled in place)."""
    _stages(run, record)
    loss = float(recipe.reduce(run, accumulate_gradients(run, record)).total_loss())
    return loss, {n: p.grad.double() for n, p in run.models.policy.named_parameters() if p.grad is not None}


def _sampled_on(record, device):
    """A copy of a freshly sampled ``record`` with its token grid on ``device`` (the group ids and
    rewards stay on the host, where ``recipe.sample`` and the reward stage make them)."""
    grid = ("tokens", "attention_mask", "assistant_mask", "sample_log_probs")
    return dataclasses.replace(record, **{name: getattr(record, name).to(device) for name in grid})


def _flat(grads, names):
    return torch.cat([grads[n].flatten() for n in names])


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_bfloat16_step_matches_float32_within_bfloat16_precision(tmp_path, lora_rank):
    """Same weights (rounded to bf16), same sampled batch. bf16 keeps 8 significant bits, a
    relative rounding of u = 2^-9 per operation; the two-layer model's step passes a few
    dozen roundings, so the gradient's relative error stays well under 16u = 2^-5 (measured:
    ~0.7-0.9 %). The loss is a mean of advantage x ratio with ratio = 1 at float32, so its
    bf16 error is at most mean|A| x the log-prob error, bounded the same way. The log-probs
    themselves come out of the vocabulary reduction in float32."""
    run32 = build_run(tiny_cfg(tmp_path / "f32", lora_rank=lora_rank))
    run16 = build_run(tiny_cfg(tmp_path / "bf16", lora_rank=lora_rank, dtype="bfloat16"))
    assert {p.dtype for p in run16.models.policy.parameters() if not p.requires_grad} <= {torch.bfloat16}
    batch = sample(run32, step_problems(run32, 0), 0)
    batch16 = dataclasses.replace(batch)
    loss32, g32 = _step(run32, batch)
    loss16, g16 = _step(run16, batch16)
    names = sorted(g32)
    assert names == sorted(g16)
    a, b = _flat(g32, names), _flat(g16, names)
    assert float((a - b).norm() / a.norm()) < 2**-5
    mean_abs_adv = float(batch.advantages.abs().sum() / batch.assistant_mask.sum())
    assert abs(loss16 - loss32) <= 2**-5 * mean_abs_adv
    mask = batch16.assistant_mask
    ref = batch16.ref_log_probs
    assert ref.dtype == torch.float32 and ref[mask].abs().min() > 0


def test_bfloat16_log_probs_are_a_float32_softmax_of_the_bfloat16_logits(tmp_path):
    """End to end through the recipe's scorer: the bf16 model's own logits, upcast, then a
    float32 log-softmax. A bf16 log-softmax would round each log-prob to 8 bits (errors up
    to ~|log p| x 2^-9, i.e. ~1e-2 here); the float32 path agrees to float32 rounding."""
    run = build_run(tiny_cfg(tmp_path / "r", dtype="bfloat16"))
    ids = IDS.clone()
    scored = run.ref_scorer.score(ids, torch.ones_like(ids, dtype=torch.bool)).log_probs
    assert scored.dtype == torch.float32
    with torch.no_grad():
        logits = run.models.reference(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16
    want = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(scored[:, 1:], want, rtol=0, atol=1e-5)
    naive = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1).float()
    assert (naive - want).abs().max() > 1e-4  # the check above could tell the two apart


def _attention_calls(model) -> list[int]:
    """A counter of the attention forwards under grad mode (a one-off no-grad probe of the
    model's head, see tether.models.scoring, is not part of the loss)."""
    calls = [0]

    def count(*_):
        calls[0] += torch.is_grad_enabled()

    for module in model.modules():
        if type(module).__name__ == "LlamaAttention":
            module.register_forward_hook(count)
    return calls


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_gradient_checkpointing_gives_the_same_gradients(tmp_path, lora_rank):
    """Recomputing activations changes nothing but the work done: sampling is identical (the
    KV cache is kept under no_grad), the gradients agree to float32 rounding, and backward
    re-runs every attention layer the loss's forward ran (none without checkpointing)."""
    plain = build_run(tiny_cfg(tmp_path / "a", lora_rank=lora_rank))
    ckpt = build_run(tiny_cfg(tmp_path / "b", lora_rank=lora_rank, gradient_checkpointing=True))
    batch = sample(plain, step_problems(plain, 0), 0)
    again = sample(ckpt, step_problems(ckpt, 0), 0)
    assert torch.equal(batch.tokens, again.tokens)
    counts = []
    for run, b in ((plain, batch), (ckpt, again)):
        _stages(run, b)
        calls = _attention_calls(run.models.policy)
        terms = recipe.token_terms(run, b)
        forward = calls[0]
        recipe.reduce(run, terms).total_loss().backward()
        counts.append((forward, calls[0] - forward))
    assert counts[0][0] > 0 and counts[0][1] == 0
    assert counts[1][0] > 0 and counts[1][1] == counts[1][0]
    for (name, p), (_, q) in zip(plain.models.policy.named_parameters(), ckpt.models.policy.named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6 * float(p.grad.abs().max()), msg=name)


# ------------------------------------------------------------------ --device
def test_device_auto_follows_cuda_availability_and_cuda_is_refused_without_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"device='cuda' but .* sees no CUDA GPU.*use device=cpu"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_on_cuda_equals_the_cpu_step(tmp_path, dtype):
    """Same batch (sampled on the CPU run), scored and differentiated on each device: the
    gradients agree to the precision of the dtype (different kernels, same math)."""
    cpu = build_run(tiny_cfg(tmp_path / "cpu", device="cpu", dtype=dtype))
    gpu = build_run(tiny_cfg(tmp_path / "gpu", device="cuda", dtype=dtype))
    assert next(gpu.models.policy.parameters()).is_cuda and gpu.generator.device.type == "cuda"
    batch = sample(cpu, step_problems(cpu, 0), 0)
    sums_cpu, g_cpu = _step(cpu, dataclasses.replace(batch))
    sums_gpu, g_gpu = _step(gpu, _sampled_on(batch, "cuda"))
    tol = 1e-4 if dtype == "float32" else 2**-5
    names = sorted(g_cpu)
    a, b = _flat(g_cpu, names), _flat({n: g.cpu() for n, g in g_gpu.items()}, names)
    assert float((a - b).norm() / a.norm()) < tol
    # Sampling draws from the GPU generator; the record comes back to the host (as seen on an
    # H200), and the loss moves each micro-batch to the device.
    before = gpu.generator.get_state().clone()
    gpu_batch = sample(gpu, step_problems(gpu, 0), 0)
    assert not torch.equal(gpu.generator.get_state(), before)
    assert gpu_batch.tokens.device.type == "cpu" and len(gpu_batch) == len(batch)


def test_a_sampling_state_from_another_device_kind_is_a_named_error():
    """A CUDA generator's state is 16 bytes (seed and offset); a CPU generator's is 5056."""
    from tether.train.sharding import load_generator_state

    with pytest.raises(ValueError, match=r"ckpt-7: its sampling RNG state \(16 bytes\) was not written by a cpu"):
        load_generator_state(torch.Generator(), torch.zeros(16, dtype=torch.uint8), "ckpt-7")
    state = torch.Generator().manual_seed(3).get_state()
    again = torch.Generator()
    load_generator_state(again, state, "ckpt-7")
    assert torch.equal(again.get_state(), state)


def test_a_resume_refuses_an_adapter_that_changed_since_the_run_started(tmp_path):
    from tether.train.checkpoint import CheckpointError

    adapter_dir = tmp_path / "adapter"
    _save_adapter(adapter_dir)
    cfg = tiny_cfg(tmp_path / "run", adapter=str(adapter_dir), lora_rank=4, steps=2)
    with pytest.warns(UserWarning):
        interrupted_train(cfg, 1)
    torch.manual_seed(1)  # the same LoRA shapes with other random factors
    _save_adapter(adapter_dir)
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="trained from another adapter than"):
        train(cfg, resume=True, progress=False)


# ------------------------------------------------------------------ pickled weights
class _Payload:
    """A pickle that would create ``path`` if it were ever unpickled by a full unpickler."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        import os

        return os.makedirs, (str(self.path),)


def test_eval_refuses_a_pickled_model_in_one_line_without_reading_it(tmp_path, capsys):
    """The run's model directory holds a ``pytorch_model.bin`` pickle and no safetensors file:
    `tether eval RUN` exits 2 with one line naming that file and saying pickles are refused (no
    traceback), and the pickle's payload never ran. The same directory with ``model.safetensors``
    beside the pickle loads the safetensors weights (the pickle is not looked at)."""
    import pickle

    from tests.train.test_run_dir import one_error_line
    from tether.train.cli import main
    from tether.train.run_dir import start_new_run

    model, tokenizer = _tiny_base()
    directory = tmp_path / "model"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "model.safetensors").rename(tmp_path / "model.safetensors")
    marker = tmp_path / "payload-ran"
    with (directory / "pytorch_model.bin").open("wb") as fh:
        pickle.dump({"weight": _Payload(marker)}, fh)
    run = tmp_path / "run"
    start_new_run(tiny_cfg(run, model=str(directory), task="arithmetic"))
    capsys.readouterr()
    assert main(["eval", str(run), "--eval-size", "2"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("tether eval: model: expected safetensors weights")
    assert f"got only the pickle {directory / 'pytorch_model.bin'}" in line and "refuses pickled weights" in line
    assert not marker.exists()
    (tmp_path / "model.safetensors").rename(directory / "model.safetensors")
    loaded, _ = load_base(str(directory), seed=0)
    torch.testing.assert_close(_token_logprobs(loaded, IDS), _token_logprobs(model, IDS), rtol=0, atol=0)
    assert not marker.exists()


def test_a_pickled_adapter_or_reward_model_is_refused_by_name(tmp_path):
    """An adapter directory holding ``adapter_model.bin`` and no safetensors, or a reward model
    directory holding ``pytorch_model.bin``, is refused before PEFT or transformers reads it."""
    from tether.models.loading import load_adapter
    from tether.train.rewards import RewardModelFunction

    reward_model = tmp_path / "rm"
    reward_model.mkdir()
    torch.save({}, reward_model / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"reward_model: expected safetensors weights \(model\*\.safetensors\) "
                                         r"in .*rm, got only the pickle .*pytorch_model\.bin; tether refuses"):
        RewardModelFunction(str(reward_model), "text", torch.device("cpu"))

    adapter = tmp_path / "adapter"
    _save_adapter(adapter)
    (adapter / "adapter_model.safetensors").unlink()
    torch.save({}, adapter / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"adapter: expected safetensors weights \(adapter_model\*\.safetensors\) "
                                         r"in .*adapter, got only the pickle .*adapter_model\.bin; tether refuses"):
        load_adapter(_tiny_base()[0], str(adapter))
