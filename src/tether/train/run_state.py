"""A run's state between processes: what a checkpoint holds beyond the weights, and how a
resume puts every piece back (RNGs, controller, schedule, reference updater, best eval,
logs cut back to the checkpoint's step), so a resumed run ends bit-identical to one that
was never stopped (on CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tether.train.checkpoint import save_checkpoint
from tether.train.data import check_data
from tether.train.devices import load_generator_state
from tether.train.run import Run
from tether.train.run_dir import open_checkpoint, write_config
from tether.train.tracking import CompletionLog


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
    rng = {"torch": torch.get_rng_state(), "sampling": run.generator.get_state()}
    save_checkpoint(root or run.dir, step, policy=run.models.policy, optimizer=run.optimizer,
                    state=_state(run, step, extra), rng=rng, reference=run.models.movable_reference,
                    keep=keep or run.cfg.keep_checkpoints)


def restore_run(run: Run) -> tuple[int, dict[str, Any]]:
    """Load the newest intact checkpoint into ``run``; returns its step and state."""
    ckpt, rng = open_checkpoint(run.cfg, run.models, run.optimizer, set_aside=True)
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
    run.metrics.truncate_after(ckpt.step)
    CompletionLog(run.dir).truncate_after(ckpt.step)
    write_config(run.dir, run.cfg)  # a resume may have changed steps or the checkpoint cadence
    return ckpt.step, ckpt.state
