"""A run's life around the recipe's steps: opened (new, or resumed from its newest checkpoint),
each step's record logged and checkpointed at its cadence, closed with the final evaluation and
the summary. A checkpoint holds the state beyond the weights, and a resume puts every piece back
(RNGs, controller, schedule, reference updater, best eval, logs cut back to the checkpoint's
step), so a resumed run ends bit-identical to one that was never stopped (on CPU). With a
sharded learner, rank 0 alone writes the run directory.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tether.train.checkpoint import (best_root, checkpoint_record, open_checkpoint, periodic_eval, save_checkpoint,
                                     start_new_run, write_config)
from tether.train.tasks import check_data
from tether.train.metrics import CompletionLog, evaluate_run, make_tracker, plot_metrics, summarize
from tether.train.run import Run
from tether.train.sharding import load_generator_state


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


def save_run(run: Run, step: int, extra: dict[str, Any], *, root: Path | None = None, keep: int | None = None) -> None:
    """Checkpoint ``run`` after ``step`` steps (``extra``: entries for state.json) under ``root``."""
    rng = {"torch": torch.get_rng_state(), "sampling": run.generator.get_state()}  # equal on every rank
    save_checkpoint(root or run.dir, step, policy=run.models.policy, optimizer=run.optimizer,
                    state=_state(run, step, extra), rng=rng, reference=run.models.movable_reference,
                    keep=keep or run.cfg.keep_checkpoints)


def restore_run(run: Run) -> tuple[int, dict[str, Any]]:
    """Load the newest intact checkpoint into ``run``; returns its step and state."""
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


@dataclass(frozen=True)
class Opened:
    """Where an opened run starts: its first step, the evaluation before training, the entries
    every checkpoint's state.json carries, and the wall clock at the start."""

    start: int
    eval_before: dict[str, Any]
    extra: dict[str, Any]
    wall: float


def open_run(run: Run, *, resume: bool) -> Opened:
    """Resume ``run`` from its newest checkpoint, or start its directory and evaluate the untrained
    policy; then open its tracker."""
    cfg, wall = run.cfg, time.perf_counter()
    if resume:
        start, state = restore_run(run)
        before = state["eval_before"]
    else:
        run.ranks.on_writer(lambda: start_new_run(cfg))
        before, start = evaluate_run(run, None, with_kl=False), 0
    if run.ranks.writer:
        run.tracker = make_tracker(cfg.report_to, run.dir, resume_step=start if resume else None,
                                   config=dataclasses.asdict(cfg))
    extra = {"eval_before": before, **checkpoint_record(cfg, run.models.fingerprint),
             "data": getattr(run.task, "fingerprint", None)}
    return Opened(start, before, extra, wall)


def close_step(run: Run, opened: Opened, record: dict[str, Any]) -> None:
    """After a step: the periodic evaluation (and best checkpoint), the record logged, and the
    checkpoint at its cadence (always after the last step)."""
    cfg, done = run.cfg, record["step"]
    if periodic_eval(run, done, record):
        save_run(run, done, opened.extra, root=best_root(run.dir), keep=1)
    if run.ranks.writer:
        run.metrics.append(record)
    run.tracker.scalars(record)
    if done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
        save_run(run, done, opened.extra)


def close_run(run: Run, opened: Opened) -> dict[str, Any]:
    """The final evaluation, then ``summary.json`` and the plots; returns the summary ({} on a
    rank that does not write)."""
    after = evaluate_run(run, run.models.reference)
    if not run.ranks.writer:
        return {}
    summary = summarize(run, opened.eval_before, after, time.perf_counter() - opened.wall)
    (run.dir / "summary.json").write_text(json.dumps(summary, indent=1))
    plot_metrics(run.dir)
    return summary
