"""The run directory's life cycle: who may write it, what a resume may change, what it holds.

A new run refuses a directory that is not empty unless ``overwrite`` is set, and checks this
before anything is loaded or written. With ``overwrite`` it removes the old run's files (only
the ones a run writes, ``RUN_FILES``) once the new run has validated its config and built its
models, so an old checkpoint is never left beside a new ``config.yaml``.

A resume may change only ``RESUMABLE_KEYS``; every other config value, and the fingerprint of
the base model and tokenizer, must equal what the checkpoint recorded. It loads the newest
checkpoint that verifies against its manifest, says which newer ones it skipped and why, and
moves those aside (``step_N.damaged``) rather than deleting them.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from tether.train.checkpoint import (Checkpoint, CheckpointError, checkpoint_dirs, load_checkpoint,
                                     newest_intact, read_state)
from tether.train.config import TrainConfig

# Config keys a resume may change: how long the run goes on and how it is saved, not what it computes.
RESUMABLE_KEYS = ("steps", "checkpoint_every", "keep_checkpoints", "threads")
_NOT_COMPARED = ("out", "overwrite")  # where the run lives and how it was started, not what it is
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "plots", "checkpoints", "best", "completions.jsonl",
             "tensorboard")


class RunDirError(ValueError):
    """The run directory cannot be used as asked (holds another run, or a resume changes it)."""


class CheckpointFallbackWarning(UserWarning):
    """The newest checkpoint was damaged; an older intact one was used instead."""


# ------------------------------------------------------------------------------ new runs
def check_new_run_dir(cfg: TrainConfig) -> None:
    """Refuse an ``out`` that is a file, or a directory that is not empty without ``overwrite``."""
    run_dir = Path(cfg.out)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"out: {run_dir} is a file, expected a run directory; choose another --out.")
    entries = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    if entries and not cfg.overwrite:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise RunDirError(
            f"out: {run_dir} is not empty ({shown}); a new run does not write into it. Continue that run "
            f"with --resume {run_dir}, replace it with --overwrite, or choose another --out."
        )


def start_new_run(cfg: TrainConfig) -> None:
    """Clear the old run's files (with ``overwrite``) and write the new run's config and empty log."""
    run_dir = Path(cfg.out)
    check_new_run_dir(cfg)  # again: the directory may have changed while the models loaded
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(run_dir, cfg)
    (run_dir / "metrics.jsonl").write_text("")


def write_config(run_dir: Path, cfg: TrainConfig) -> None:
    """``config.yaml``, replaced atomically; ``overwrite`` is an action, not part of the run."""
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(dataclasses.replace(cfg, overwrite=False).to_yaml())
    os.replace(tmp, run_dir / "config.yaml")


def read_run_config(run_dir: Path) -> TrainConfig:
    """The ``config.yaml`` of an existing run, with ``out`` pointing at where the run is now."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise RunDirError(f"{path}: not found; {run_dir} is not a tether run directory.")
    return TrainConfig.from_yaml(path).override({"out": str(run_dir)})


def describe_checkpoints(run_dir: Path) -> str:
    """A true sentence about what a failed run leaves behind to resume from."""
    steps = [int(p.name.split("_")[1]) for p in checkpoint_dirs(Path(run_dir))]
    if not steps:
        return f"{run_dir} holds no checkpoint of this run (start it again with --overwrite)."
    return (f"{run_dir} holds the checkpoints of steps {', '.join(map(str, steps))}; continue with "
            f"tether train --resume {run_dir}.")


# ------------------------------------------------------------------------------ resume
def changed_keys(recorded: dict[str, Any], cfg: TrainConfig, allowed: tuple[str, ...]) -> list[str]:
    """``key (recorded -> now)`` for each config value that differs and may not."""
    names = set(TrainConfig.field_names())
    out = []
    for key, old in recorded.items():
        if key in names and key not in allowed and key not in _NOT_COMPARED and getattr(cfg, key) != old:
            out.append(f"{key} ({old!r} -> {getattr(cfg, key)!r})")
    return out


def check_resume_overrides(stored: TrainConfig, cfg: TrainConfig) -> None:
    """The CLI's flags and overrides on ``--resume`` change only ``RESUMABLE_KEYS``."""
    changed = changed_keys(dataclasses.asdict(stored), cfg, RESUMABLE_KEYS)
    if changed:
        raise RunDirError(
            f"--resume {stored.out}: cannot change {', '.join(changed)}; a resume may change only "
            f"{', '.join(RESUMABLE_KEYS)}. Start a new run with another --out to change the others."
            + (" A sharded run resumes on as many processes as it trained on: another split adds its sums in "
               "another order, so the run would not continue bit-exactly." if stored.nproc != cfg.nproc else "")
        )
    if cfg.overwrite:
        raise RunDirError(f"--resume {stored.out} and --overwrite contradict each other; give one of them.")


def checkpoint_record(cfg: TrainConfig, fingerprint: dict[str, str]) -> dict[str, Any]:
    """What a checkpoint records about its run: the config and the base it was trained on."""
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_COMPARED}
    return {"config": config, "base": {"model": cfg.model, **fingerprint}}


def _check_record(path: Path, state: dict[str, Any], cfg: TrainConfig, fingerprint: dict[str, str],
                  allowed: tuple[str, ...]) -> None:
    absent = [key for key in ("config", "base") if key not in state]
    if absent:
        raise CheckpointError(f"{path / 'state.json'}: missing the entries {absent}.")
    changed = changed_keys(state["config"], cfg, allowed)
    if changed:
        raise CheckpointError(
            f"{path}: written with another config than {cfg.out}/config.yaml: {', '.join(changed)}. Only "
            f"{', '.join(allowed)} may differ; restore config.yaml, or start a new run in another directory."
        )
    base = state["base"]
    if "adapter" in fingerprint and base.get("adapter") != fingerprint["adapter"]:
        raise CheckpointError(
            f"{path}: trained from another adapter than the one now in {cfg.adapter} (digest "
            f"{str(base.get('adapter'))[:12]} then, {fingerprint['adapter'][:12]} now), so the run's reference "
            "would change; restore that adapter directory, or start a new run in another directory."
        )
    if {k: base.get(k) for k in fingerprint} != fingerprint:
        raise CheckpointError(
            f"{path}: trained on base model {base.get('model')!r} (weights {str(base.get('weights'))[:12]}, "
            f"tokenizer {str(base.get('tokenizer'))[:12]}), but model {cfg.model!r} now loads weights "
            f"{fingerprint['weights'][:12]}, tokenizer {fingerprint['tokenizer'][:12]}. The checkpoint's "
            "weights belong to the first; point model at that base."
        )


def open_checkpoint(cfg: TrainConfig, models: Any, optimizer: torch.optim.Optimizer, *,
                    allowed: tuple[str, ...] = RESUMABLE_KEYS, set_aside: bool = False,
                    root: Path | None = None) -> tuple[Checkpoint, dict[str, torch.Tensor]]:
    """Load the newest intact checkpoint of ``cfg.out`` into ``models``/``optimizer`` after checking
    that it was written by this config on this base; warn about (and optionally set aside) newer
    damaged ones. ``root`` reads the checkpoints of another directory of the run (``best/``)."""
    run_dir = Path(root or cfg.out)
    path, skipped = newest_intact(run_dir)
    state = read_state(path)
    _check_record(path, state, cfg, models.fingerprint, allowed)
    if skipped:
        warnings.warn(f"{' '.join(skipped)} Using the newest intact checkpoint, {path}.",
                      CheckpointFallbackWarning, stacklevel=2)
    if set_aside:
        for newer in checkpoint_dirs(run_dir):
            if newer == path:
                break
            target, n = newer.with_name(newer.name + ".damaged"), 1
            while target.exists():
                target, n = newer.with_name(f"{newer.name}.damaged{n}"), n + 1
            os.replace(newer, target)
    return load_checkpoint(path, policy=models.policy, optimizer=optimizer,
                           reference=models.movable_reference)
