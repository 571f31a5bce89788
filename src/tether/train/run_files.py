"""The checkpoints a run directory holds, and the sentence telling a user what is left to resume.

Error messages of the loop append ``describe_checkpoints`` (a failed reward function, a
non-finite update, a dead Ray worker), so this module imports nothing of tether's: every
module may use it.
"""

from __future__ import annotations

import re
from pathlib import Path

_STEP_DIR = re.compile(r"step_(\d+)")


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The run's checkpoint directories, newest step first (damaged ones included)."""
    root = run_dir / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def describe_checkpoints(run_dir: Path) -> str:
    """A true sentence about what a failed run leaves behind to resume from."""
    steps = [int(p.name.split("_")[1]) for p in checkpoint_dirs(Path(run_dir))]
    if not steps and not (Path(run_dir) / "config.yaml").is_file():
        return f"{run_dir} holds no checkpoint of this run (start it again with --overwrite)."
    if not steps:
        return (f"{run_dir} holds no checkpoint of this run; tether train --resume {run_dir} starts it again from "
                "step 0 with its config.yaml (or start over with --overwrite).")
    return (f"{run_dir} holds the checkpoints of steps {', '.join(map(str, steps))}; continue with "
            f"tether train --resume {run_dir}.")
