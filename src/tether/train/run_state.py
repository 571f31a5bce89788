"""Where a run directory stands when ``--resume`` names it: finished, not yet checkpointed, or
resumable, each checked for consistency before anything is loaded or written.

A finished run (newest intact checkpoint at ``steps``, ``summary.json`` written) is left as it is,
but only after the checks a resume makes: ``config.yaml`` against the config the checkpoint
recorded, the base model against its fingerprint there, ``metrics.jsonl`` holding each of its
steps once, and ``completions.jsonl`` and ``summary.json`` readable. A run stopped before its first checkpoint
lost nothing that a restart does not recompute: it starts again from step 0 with its
``config.yaml`` (flags may change only what a resume may) and says so in one line.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import warnings
from pathlib import Path

from tether.train.checkpoint import CheckpointError, check_record, newest_intact, read_state
from tether.train.run_dir import RESUMABLE_KEYS, RunDirError, changed_keys, read_run_config
from tether.train.run_files import checkpoint_dirs
from tether.train.config import TrainConfig
from tether.train.jsonl import read_jsonl


class RunStopped(RuntimeError):
    """A process the run depends on died (a Ray rollout worker): the run stops with one line naming
    what its directory holds to resume from. The CLI reports it as it reports a user error."""


class RestartNote(UserWarning):
    """``--resume`` of a run stopped before its first checkpoint: it starts again from step 0."""


def finished_line(cfg: TrainConfig) -> str | None:
    """The line for ``--resume`` of a run with nothing left to do, after checking its directory as a
    resume would (a ``CheckpointError`` or ``ValueError`` names the edited key or damaged file); None
    when the resume goes on (and makes its own checks)."""
    run_dir = Path(cfg.out)
    try:
        path, _ = newest_intact(run_dir)
        state = read_state(path)
    except CheckpointError:
        return None  # the resume reports what is wrong, or restarts a run with no checkpoint yet
    step = int(state["step"])
    if step != cfg.steps or not (run_dir / "summary.json").is_file():
        return None
    check_record(path, state, cfg, {}, RESUMABLE_KEYS)  # the config first: an edited model is named, not loaded
    check_record(path, state, cfg, base_fingerprint(cfg), RESUMABLE_KEYS)
    check_logs(run_dir, step)
    summary = run_dir / "summary.json"
    try:
        json.loads(summary.read_text())
    except ValueError as exc:
        raise ValueError(f"{summary}: not readable JSON ({exc}); delete it and run the same --resume again to "
                         "write it anew (the final evaluation runs again).") from exc
    quoted = shlex.quote(str(run_dir))
    return (f"tether train: {run_dir} is finished (step {step} of {cfg.steps}, summary.json written); nothing to "
            f"resume. Train on with --resume {quoted} --steps N (N > {step}); score it with tether eval {quoted}.")


def base_fingerprint(cfg: TrainConfig) -> dict[str, str]:
    """The fingerprint of ``cfg.model``'s base weights and tokenizer as a run loads them (the model is
    loaded, no adapter and no optimizer): a finished run refuses a base replaced in place, too."""
    from tether.models.loading import fingerprint, load_base
    from tether.train.sharding import resolve_dtype

    base, tokenizer = load_base(cfg.model, cfg.seed, resolve_dtype(cfg.dtype))
    return fingerprint(base, tokenizer)


def check_logs(run_dir: Path, step: int) -> None:
    """``metrics.jsonl`` holds the lines of steps 1..``step`` once each and ``completions.jsonl``
    parses; raises ``ValueError`` naming the file (and line)."""
    from tether.train.metrics import MetricsLog

    MetricsLog(run_dir / "metrics.jsonl").kept_through(step)
    read_jsonl(run_dir / "completions.jsonl")


def restarts(cfg: TrainConfig, *, say: bool = True) -> bool:
    """Whether ``--resume`` of ``cfg.out`` starts the run again from step 0: its config.yaml is there
    but no checkpoint directory (the process stopped before its first checkpoint). Warns
    ``RestartNote`` with what is recomputed; a ``cfg`` that changes config.yaml beyond
    ``RESUMABLE_KEYS`` is refused (``RunDirError``) as on any resume; ``say``: warn (the
    writing rank)."""
    from tether.train.metrics import MetricsLog

    run_dir = Path(cfg.out)
    if checkpoint_dirs(run_dir) or not (run_dir / "config.yaml").is_file():
        return False
    stored = read_run_config(run_dir)
    changed = changed_keys(dataclasses.asdict(stored), cfg, RESUMABLE_KEYS)
    if changed:
        raise RunDirError(f"resume {run_dir}: cannot change {', '.join(changed)} of its config.yaml; a resume may "
                          f"change only {', '.join(RESUMABLE_KEYS)}. Start a new run with another --out to change "
                          "the others.")
    if not say:  # another rank of a sharded run: rank 0 says it
        return True
    logged = len(MetricsLog(run_dir / "metrics.jsonl").read())
    again = f"; the {logged} logged step(s) without a checkpoint are run again" if logged else ""
    warnings.warn(f"resume {run_dir}: the run stopped before its first checkpoint, so nothing was lost; it starts "
                  f"again from step 0 with its config.yaml{again}.", RestartNote, stacklevel=2)
    return True
