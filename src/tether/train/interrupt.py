"""Ctrl-C during ``tether train``: one line naming the newest intact checkpoint, status 130.

Nothing is lost (checkpoints are written atomically); the line gives the command that resumes
from the checkpoint, or says that nothing was written yet. ``interrupts_reach_the_run`` makes a
Ctrl-C that lands in a finaliser reach the run instead of being dropped.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import shlex
import signal
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

from tether.train.checkpoint import CheckpointError, newest_intact, read_state
from tether.train.config import TrainConfig
from tether.train.launch import LAUNCHED_ENV
from tether.train.run_files import checkpoint_dirs


# ------------------------------------------------------------------------------ Ctrl-C
# The newest intact checkpoint is where a resume starts, as after a kill. Of a sharded run one
# process speaks: the launcher ``--nproc`` starts (its ranks stay silent), or rank 0 under a
# torchrun the user started. 130 is the shell's status for a process ended by SIGINT.
INTERRUPTED = 130  # 128 + SIGINT


def speaks() -> bool:
    """Whether this process reports the interruption (one line for the whole run)."""
    rank = os.environ.get("RANK")
    return rank is None or (rank == "0" and LAUNCHED_ENV not in os.environ)


def resume_command(run_dir: Path, *, copied: bool) -> str:
    """The command that continues ``run_dir``: ``tether train --resume RUN`` as this program was
    started (``.venv/bin/tether`` stays so), or ``python COPY --resume RUN`` for a copied recipe."""
    program = sys.argv[0] if sys.argv and sys.argv[0] else "tether"
    if copied:
        start = f"python {shlex.quote(program)}"
    else:
        start = f"{shlex.quote(program) if Path(program).name == 'tether' else 'tether'} train"
    return f"{start} --resume {shlex.quote(str(run_dir))}"


def interruption_line(cfg: TrainConfig | None, *, copied: bool) -> str:
    """The one line for a run stopped by Ctrl-C: its newest intact checkpoint and how to go on."""
    if cfg is None:
        return "tether train: interrupted before the run started; nothing was written."
    run_dir = Path(cfg.out)
    try:
        path, _ = newest_intact(run_dir)
        step = int(read_state(path)["step"])
    except CheckpointError:
        if (run_dir / "config.yaml").is_file() and not checkpoint_dirs(run_dir):  # --resume starts it again
            return (f"tether train: interrupted before the first checkpoint of {run_dir}; nothing was lost: "
                    f"{resume_command(run_dir, copied=copied)} starts it again from step 0 with its config.yaml.")
        again = " with --overwrite" if run_dir.is_dir() and any(run_dir.iterdir()) else ""
        return (f"tether train: interrupted before the first checkpoint of {run_dir}: no checkpoint exists yet, so "
                f"there is nothing to resume; run the same command again{again} to start over.")
    return (f"tether train: interrupted; the newest intact checkpoint is {path} (step {step} of {cfg.steps}); "
            f"continue with: {resume_command(run_dir, copied=copied)}")


def report_interruption(cfg: TrainConfig | None, exc: KeyboardInterrupt, *, copied: bool) -> int:
    """Print ``interruption_line`` (from the one process that speaks) and return 130."""
    # Free the interrupted frames first: a progress bar they hold then ends its line before ours.
    traceback.clear_frames(exc.__traceback__)
    try:  # a second Ctrl-C while the checkpoints are verified would print a traceback after all
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals cannot be set here
        previous = None
    try:
        if speaks():
            print(interruption_line(cfg, copied=copied), file=sys.stderr, flush=True)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return INTERRUPTED


@contextlib.contextmanager


def interrupts_reach_the_run() -> Iterator[None]:
    """Within: a KeyboardInterrupt raised in a finaliser, which Python reports as unraisable and
    drops, is raised again in the main thread instead, with nothing printed."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            # From another thread: raised here, inside the hook, Python would drop it again.
            _thread.start_new_thread(_thread.interrupt_main, ())  # no wait for it to start
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
