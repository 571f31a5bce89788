"""The run directory's rules: what a new run may write into, what a resume may change.

A new run refuses a directory that is not empty unless ``overwrite`` is set, and then removes
only the files a run writes (``RUN_FILES``). A resume may change only ``RESUMABLE_KEYS``; every
other config value must equal what the run recorded (``changed_keys``). ``config.yaml`` is
written atomically and read back with ``out`` pointing where the run is now. ``best_root`` is
where the periodic evaluation keeps the best checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

from tether.train.config import TrainConfig


# ------------------------------------------------------------------------------ the run directory
# A new run checks its ``out`` before anything is loaded or written; with ``overwrite`` it removes the
# old run's files once the new run has validated its config and built its models, so an old checkpoint
# is never left beside a new ``config.yaml``. A resume loads the newest checkpoint that verifies
# against its manifest, says which newer ones it skipped and why, and moves those aside
# (``step_N.damaged``) rather than deleting them.

# Config keys a resume may change: how long the run goes on and how it is saved, not what it computes.
RESUMABLE_KEYS = ("steps", "checkpoint_every", "keep_checkpoints", "threads")
NOT_COMPARED = ("out", "overwrite")  # where the run lives and how it was started, not what it is
_START_LEFTOVERS = (".config.yaml.tmp",)
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "plots", "checkpoints", "best", "completions.jsonl",
             "tensorboard")


class RunDirError(ValueError):
    """The run directory cannot be used as asked (holds another run, or a resume changes it)."""


# ------------------------------------------------------------------------------ new runs
def check_new_run_dir(cfg: TrainConfig) -> None:
    """Refuse an ``out`` that is a file, or a directory that is not empty without ``overwrite``."""
    run_dir = Path(cfg.out)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"out: {run_dir} is a file, expected a run directory; choose another --out.")
    # what a process killed while starting the run left half-written holds nothing of a run
    entries = sorted(p.name for p in run_dir.iterdir() if p.name not in _START_LEFTOVERS) if run_dir.is_dir() else []
    if entries and not cfg.overwrite:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise RunDirError(
            f"out: {run_dir} is not empty ({shown}); a new run does not write into it. Continue that run "
            f"with --resume {run_dir}, replace it with --overwrite, or choose another --out."
        )


def start_new_run(cfg: TrainConfig, *, restart: bool = False) -> None:
    """``clear_run_dir`` then ``write_run_start``: the new run's config and empty log."""
    clear_run_dir(cfg, restart=restart)
    write_run_start(cfg)


def clear_run_dir(cfg: TrainConfig, *, restart: bool = False) -> None:
    """Remove the old run's files (with ``overwrite``); ``restart``: the run's own files written
    before its first checkpoint, keeping its config.yaml (the trackers open before it is rewritten)."""
    run_dir = Path(cfg.out)
    if not restart:
        check_new_run_dir(cfg)  # again: the directory may have changed while the models loaded
    for name in (*RUN_FILES, *_START_LEFTOVERS, ".summary.json.tmp"):
        path = run_dir / name
        if restart and name == "config.yaml":
            continue
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def write_run_start(cfg: TrainConfig) -> None:
    """The new run's config.yaml and empty metrics.jsonl."""
    run_dir = Path(cfg.out)
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


# ------------------------------------------------------------------------------ resume
def changed_keys(recorded: dict[str, Any], cfg: TrainConfig, allowed: tuple[str, ...]) -> list[str]:
    """``key (recorded -> now)`` for each config value that differs and may not."""
    names = set(TrainConfig.field_names())
    out = []
    for key, old in recorded.items():
        if key in names and key not in allowed and key not in NOT_COMPARED and getattr(cfg, key) != old:
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

BEST_DIR = "best"


def best_root(run_dir: Path, *, required: bool = False) -> Path:
    """The directory whose ``checkpoints/`` holds the best checkpoint of ``run_dir``; with
    ``required``, a ``ValueError`` for ``--best`` if the run kept none."""
    root = Path(run_dir) / BEST_DIR
    if required and not (root / "checkpoints").is_dir():
        raise ValueError(f"--best: {run_dir} has no best checkpoint ({root}/checkpoints); the run kept none "
                         "because it ran without eval_every. Use its latest checkpoint: leave out --best.")
    return root
