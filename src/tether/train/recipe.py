"""The GRPO recipe with a KL leash: config -> models -> rollout -> reward -> advantage -> loss
-> step -> log, once per step, with exact resume.

Each step draws ``prompts_per_step`` problems, samples ``group_size`` answers per problem,
scores them with the task's reward, gets the reference log-probs, turns rewards into group
advantages, and takes ``updates_per_rollout`` optimizer steps on ``GRPOLoss`` over mini-batches
of the step's batch (``tether.train.updates``; one by default), each with its gradient
accumulated over micro-batches with full-batch denominators, so an update does not depend on
the micro-batch size. The learning rate follows ``tether.train.schedule``. The KL leash is
either a gradient-correct loss term (default) or a k1 per-token reward penalty with
reward-to-go; its coefficient can follow an adaptive controller.

Determinism: problems are a pure function of (seed, index), sampling uses its own seeded
generator, and checkpoints carry every piece of state, so a run killed after any checkpoint
and resumed ends bit-identical to an uninterrupted one (on CPU).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tether.objectives import GRPOTokenTerms
from tether.ops import aggregate_denominator, group_advantages, reward_to_go
from tether.train.best import best_root, periodic_eval
from tether.train.checkpoint import save_checkpoint
from tether.train.config import TrainConfig
from tether.train.devices import load_generator_state
from tether.train.data import check_data, prompt_batch
from tether.train.evaluate import evaluate
from tether.train.kl_signal import has_exact_kl, measure_kl
from tether.train.metrics import plot_metrics
from tether.train.run_dir import (check_new_run_dir, checkpoint_record, describe_checkpoints, open_checkpoint,
                                  start_new_run, write_config)
from tether.train.rewards import RewardError, Scores, samples_from_batch
from tether.train.tasks import Problem
from tether.train.tracking import CompletionLog, log_completions, make_tracker
from tether.train.updates import minibatch_bounds, store_old_log_probs
from tether.train.run import Run, build_run
from tether.train.sharding import gather_kl, gather_scores, gather_terms
from tether.train.tool_rollout import tool_metrics, tool_rollout, tool_summary


class NonFiniteUpdateError(ValueError):
    """A step's loss or gradient norm is NaN or infinite; the optimizer step was not taken."""


# ------------------------------------------------------------------------------ one step
def rollout(run: Run, step: int) -> tuple[Any, list[Problem]]:
    """Sample ``group_size`` answers for each of the step's problems."""
    cfg = run.cfg
    first = step * cfg.prompts_per_step
    problems = [run.task.train_problem(cfg.seed, first + i, run.excluded)
                for i in run.ranks.share(cfg.prompts_per_step)]  # this rank's whole groups
    repeated = [p for p in problems for _ in range(cfg.group_size)]
    if run.task.tool_use is not None:
        return tool_rollout(run, repeated), repeated
    if run.workers is not None:
        # Ray workers sample whole groups with the learner's current weights, and score the
        # reference log-probs through the shared ReferenceService while they are at it.
        chats = [p.chat for p in repeated]
        return run.workers.rollout(run.models.policy, chats, step, reference_updater=run.ref_updater), repeated
    batch = prompt_batch(repeated, cfg.prompt_format)
    with torch.no_grad():
        run.sampler(batch)
    return batch, repeated


def score_batch(run: Run, batch, problems: list[Problem], step: int) -> Scores:
    """The step's rewards ``[B]``, correctness and per-function values; a failing reward names its sample."""
    try:
        return run.scorer.score(samples_from_batch(batch, problems), where=f"step {step + 1}")
    except RewardError as exc:
        raise _with_checkpoints(run, exc) from exc


def _with_checkpoints(run: Run, exc: RewardError) -> RewardError:
    """``exc`` followed by what the run directory holds to resume from."""
    return RewardError(f"{exc} {describe_checkpoints(run.dir)}")


def score_rewards(run: Run, batch, problems: list[Problem], step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rewards ``[B]`` and correctness ``[B]`` (None when the task defines none) of ``score_batch``."""
    scores = score_batch(run, batch, problems, step)
    return scores.total, scores.correct


def add_advantages(run: Run, batch, rewards: torch.Tensor) -> torch.Tensor:
    """Write ``advantage`` and ``("ref_log_probs", "full")``; return per-sequence k1 KL."""
    cfg = run.cfg
    tokens, attn = batch["tokens", "full"], batch["masks", "all_attention_mask"]
    mask = batch["masks", "all_assistant_mask"]
    if run.workers is not None:
        ref_lp = batch["ref_log_probs", "full"]  # scored by the ReferenceService during the rollout
    else:
        with torch.no_grad():
            ref_lp = run.ref_scorer.score(tokens, attn).log_probs.to(tokens.device)
    batch.set(("ref_log_probs", "full"), ref_lp)
    log_ratio = (batch["log_probs", "full"] - ref_lp) * mask
    groups = torch.arange(rewards.numel() // cfg.group_size).repeat_interleave(cfg.group_size)
    advantage = group_advantages(rewards, groups, mode=cfg.advantage)
    if cfg.kl_mode == "reward":
        # k1 penalty per token; its reward-to-go is added to the outcome advantage.
        penalty = reward_to_go(-run.coef.kl_coef * log_ratio, mask)
        batch.set("advantage", (advantage[:, None] + penalty) * mask)
    else:
        batch.set("advantage", advantage[:, None].expand_as(mask) * mask)
    return log_ratio.sum(-1)


def accumulate_gradients(run: Run, batch, kept: list[GRPOTokenTerms] | None = None) -> dict[str, float]:
    """Backward of the step's loss, micro-batch by micro-batch, with full-batch denominators.

    The diagnostics are not averaged over micro-batches (ESS is no token mean): each
    micro-batch's detached per-token terms are kept and reduced once over the whole batch,
    so every logged value equals that of one full-batch ``GRPOLoss`` call. The terms are also
    appended to ``kept`` when given (``optimize`` reduces those of all its updates at once).
    """
    cfg = run.cfg
    denominator = run.ranks.total(aggregate_denominator(batch["masks", "all_assistant_mask"], cfg.aggregation))
    run.optimizer.zero_grad(set_to_none=True)
    kept = [] if kept is None else kept
    start = len(kept)
    for begin in range(0, batch.shape[0], cfg.micro_batch_size):
        terms = run.loss.token_terms(batch[begin : begin + cfg.micro_batch_size])
        run.loss.reduce(terms, denominator=denominator).total_loss().backward()
        kept.append(terms.detach())
    return _diagnostics(run, kept[start:])


def _diagnostics(run: Run, kept: list[GRPOTokenTerms]) -> dict[str, float]:
    out = run.loss.reduce(gather_terms(run.ranks, GRPOTokenTerms.cat(kept)))
    diagnostics = {name: getattr(out, name) for name in ("clip_fraction", "ESS", "entropy", "kl_to_ref")}
    sums = {name: float(value) for name, value in diagnostics.items() if value is not None}
    sums["loss"] = float(out.total_loss())
    return sums


def optimize(run: Run, batch, step: int | None = None) -> dict[str, float]:
    """``updates_per_rollout`` optimizer steps over mini-batches of the batch (``tether.train.updates``).

    The logged diagnostics and loss reduce the per-token terms of every update together;
    ``grad_norm`` is the mean of the updates' norms before clipping.
    """
    cfg = run.cfg
    if cfg.updates_per_rollout > 1 and run.loss.importance_correction is not None:
        store_old_log_probs(run.loss, batch, cfg.micro_batch_size)
    kept: list[GRPOTokenTerms] = []
    norms = [_update(run, batch[begin:end], kept, step)
             for begin, end in minibatch_bounds(batch.shape[0], cfg.updates_per_rollout)]
    sums = _diagnostics(run, kept)
    sums["grad_norm"] = sum(norms) / len(norms)
    return sums


def _update(run: Run, batch, kept: list[GRPOTokenTerms], step: int | None) -> float:
    """One optimizer step over ``batch`` (``step``, 0-based, names it in errors); a non-finite
    loss or gradient norm raises before the optimizer touches the weights."""
    cfg = run.cfg
    sums = accumulate_gradients(run, batch, kept)
    params = [p for p in run.models.policy.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip else float("inf"))
    if not (math.isfinite(sums["loss"]) and math.isfinite(float(norm))):
        raise NonFiniteUpdateError(
            f"step {'?' if step is None else step + 1}: loss {sums['loss']}, gradient norm {float(norm)}; the update "
            "was not applied, logged or checkpointed. Lower learning_rate, set grad_clip, or check the rewards' "
            f"scale. {describe_checkpoints(run.dir)}"
        )
    run.optimizer.step()
    return float(norm)


def train_step(run: Run, step: int) -> dict[str, Any]:
    cfg = run.cfg
    start = time.perf_counter()
    with run.ranks.unsharded():  # no FSDP collective inside the no-grad passes (tether.train.sharding)
        batch, problems = rollout(run, step)
        scores = score_batch(run, batch, problems, step)
        rewards = scores.total
        kl_seq = add_advantages(run, batch, rewards)
        # Measured before the update: both KLs then describe the policy that sampled the batch.
        policy = run.models.policy
        exact = cfg.kl_signal == "exact" and has_exact_kl(policy)
        kl = gather_kl(run.ranks, measure_kl(batch, kl_seq, policy=policy if exact else None,
                                             reference=run.models.reference, temperature=cfg.temperature))
    lr = run.optimizer.param_groups[0]["lr"]
    opt = optimize(run, batch, step)
    run.scheduler.step()
    if run.ranks.writer:
        log_completions(run, step + 1, [p.chat[-1]["content"] for p in problems], batch, rewards, scores.correct)
    if run.ref_updater is not None:
        run.ref_updater.step(step + 1)
    kl_coef_used = float(run.coef.kl_coef)
    run.controller.update(kl.signal.tolist())
    mask = batch["masks", "all_assistant_mask"]
    scores = gather_scores(run.ranks, scores)  # every rank's rows from here on
    elapsed = time.perf_counter() - start
    return {
        "step": step + 1,
        "reward_mean": float(scores.total.mean()),
        "reward_std": float(scores.total.std()),
        **({} if scores.correct is None else {"accuracy": float(scores.correct.mean())}),
        **{f"reward/{name}": float(v.nanmean()) for name, v in scores.per_function.items()},
        **kl.metrics(cfg.kl_bound),
        "kl_coef": kl_coef_used,
        "clip_fraction": opt.get("clip_fraction", 0.0),
        "ess": opt.get("ESS", float("nan")),
        "entropy": opt.get("entropy", float("nan")),
        "response_length": float(run.ranks.rows(mask.sum(-1)).float().mean()),
        "grad_norm": opt["grad_norm"],
        "lr": lr,
        "loss": opt["loss"],
        "step_time": elapsed,
        "tokens_per_s": float(run.ranks.total(batch["masks", "all_attention_mask"].sum())) / elapsed,
        **tool_metrics(batch),
    }


# ------------------------------------------------------------------------------ state
def _state(run: Run, step: int, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "data_cursor": step * run.cfg.prompts_per_step,
        "controller": run.controller.state_dict(),
        # The moved reference weights go to reference.safetensors, not into state.json.
        "reference_updater": run.ref_updater.state_dict(with_tensors=False) if run.ref_updater else None,
        "lr_scheduler": run.scheduler.state_dict(),
        "best_eval": run.best.state_dict(),
        **extra,
    }


def _save(run: Run, step: int, extra: dict[str, Any], *, root: Path | None = None, keep: int | None = None) -> None:
    rng = {"torch": torch.get_rng_state(), "sampling": run.generator.get_state()}  # equal on every rank
    save_checkpoint(root or run.dir, step, policy=run.models.policy, optimizer=run.optimizer,
                    state=_state(run, step, extra), rng=rng, reference=run.models.movable_reference,
                    keep=keep or run.cfg.keep_checkpoints)


def _restore(run: Run) -> tuple[int, dict[str, Any]]:
    ckpt, rng = open_checkpoint(run.cfg, run.models, run.optimizer, set_aside=run.ranks.writer)
    if ckpt.step > run.cfg.steps:
        raise ValueError(f"steps: {run.cfg.steps} is below the step of {ckpt.path} ({ckpt.step}); "
                         f"a resume can only extend a run, so give steps >= {ckpt.step}.")
    torch.set_rng_state(rng["torch"])
    load_generator_state(run.generator, rng["sampling"], ckpt.path)
    run.controller.load_state_dict(ckpt.state["controller"])
    if run.ref_updater is not None and ckpt.state.get("reference_updater"):
        run.ref_updater.load_state_dict(ckpt.state["reference_updater"])
    if "lr_scheduler" in ckpt.state:
        run.scheduler.load_state_dict(ckpt.state["lr_scheduler"])
    run.best.load_state_dict(ckpt.state.get("best_eval"))
    check_data(ckpt.state, run.task, ckpt.path)
    if run.ranks.writer:
        run.metrics.truncate_after(ckpt.step)
        CompletionLog(run.dir).truncate_after(ckpt.step)
        write_config(run.dir, run.cfg)  # a resume may have changed steps or the checkpoint cadence
    return ckpt.step, ckpt.state


# ------------------------------------------------------------------------------ main loop
def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True, stop_after: int | None = None) -> dict[str, Any]:
    """Run (or resume) training; returns the summary also written to ``summary.json``.

    ``stop_after`` ends the process-level loop after that many steps without the final
    evaluation (used to simulate an interrupted run in tests).
    """
    if not resume:
        check_new_run_dir(cfg.validate())  # before loading anything: refuse another run's directory
    run = build_run(cfg)
    try:
        wall = time.perf_counter()
        if resume:
            start, state = _restore(run)
            before = state["eval_before"]
        else:
            if run.ranks.writer:
                start_new_run(cfg)
            before = _evaluate(run, None, with_kl=False)
            start = 0
        if run.ranks.writer:
            run.tracker = make_tracker(cfg.report_to, run.dir, resume_step=start if resume else None)
        extra = {"eval_before": before, **checkpoint_record(cfg, run.models.fingerprint),
                 "data": getattr(run.task, "fingerprint", None)}
        bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="tether train",
                   disable=not (progress and run.ranks.writer), dynamic_ncols=True)
        for step in bar:
            record = train_step(run, step)
            if periodic_eval(run, step + 1, record):
                _save(run, step + 1, extra, root=best_root(run.dir), keep=1)
            if run.ranks.writer:
                run.metrics.append(record)
            run.tracker.scalars(record)
            accuracy = {"acc": f"{record['accuracy']:.2f}"} if "accuracy" in record else {}  # none in dataset runs
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}", **accuracy, kl=f"{record['kl_per_seq']:.3f}",
                            beta=f"{record['kl_coef']:.3g}")
            done = step + 1
            if done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                _save(run, done, extra)
            if stop_after is not None and done - start >= stop_after and done < cfg.steps:
                return {"stopped_at": done}
        if run.workers is not None:
            run.workers.shutdown()  # the final evaluation runs in-process; free the Ray actors first
        after = _evaluate(run, run.models.reference)
        summary = _summary(run, before, after, time.perf_counter() - wall)
        if run.ranks.writer:
            (run.dir / "summary.json").write_text(json.dumps(summary, indent=1))
            plot_metrics(run.dir)
        return summary
    finally:
        run.tracker.close()
        if run.workers is not None:
            run.workers.shutdown()  # also when a step raised: the actors hold the cluster's CPUs


def _evaluate(run: Run, reference: Any, with_kl: bool = True) -> dict[str, Any]:
    """Held-out accuracy, reward and (``with_kl``) KL of the policy, as a dict."""
    try:
        return evaluate(run.models.policy, reference, run.models.tokenizer, run.task, run.held_out,
                        max_new_tokens=run.cfg.eval_max_new_tokens, temperature=run.cfg.temperature,
                        with_kl=with_kl, scorer=run.scorer, prompt_format=run.cfg.prompt_format).as_dict()
    except RewardError as exc:
        raise _with_checkpoints(run, exc) from exc


def _summary(run: Run, before: dict, after: dict, seconds: float) -> dict[str, Any]:
    records = run.metrics.read()
    tail = records[-3:] if records else []
    final_kl = sum(r["kl_per_seq"] for r in tail) / max(len(tail), 1)
    return {
        "model": run.cfg.model,
        "task": run.task.name,
        "steps": run.cfg.steps,
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "accuracy_gain_points": None if after["accuracy"] is None else 100 * (after["accuracy"] - before["accuracy"]),
        "reward_before": before.get("reward"),
        "reward_after": after.get("reward"),
        **{f"reward/{name}_{when}": value for when, result in (("before", before), ("after", after))
           for name, value in result.get("rewards", {}).items()},
        "eval_kl_per_token": after["kl_per_token"],
        "eval_kl_per_seq": after["kl_per_seq"],
        "final_train_kl_per_seq": final_kl,
        "kl_bound": run.cfg.kl_bound,
        "kl_within_bound": final_kl <= run.cfg.kl_bound,
        "steps_over_kl_bound": sum(bool(r.get("kl_over_bound")) for r in records),
        "final_train_kl_exact_per_seq": _tail_mean(tail, "kl_exact_per_seq"),
        "final_kl_coef": float(run.coef.kl_coef),
        "seconds_this_process": seconds,
        "eval_size": len(run.held_out),
        **({"best_eval_step": run.best.step, "best_eval_accuracy": run.best.accuracy} if run.cfg.eval_every else {}),
        **tool_summary(before, after),
    }


def _tail_mean(tail: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in tail if key in r]
    return sum(values) / len(values) if values else None
