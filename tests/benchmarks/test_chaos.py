"""Chaos (issue 43, item 8): tiny runs SIGKILLed before their first checkpoint, while a checkpoint is
written and at a random moment each resume to the clean run's final weights, byte for byte. The
50-run version is ``python benchmarks/chaos.py --runs 50``; this one costs about a minute."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from chaos import chaos  # noqa: E402


def test_killed_runs_resume_to_the_clean_weights_byte_for_byte(tmp_path):
    """Three 3-step runs, one per moment: the kill before the first checkpoint leaves logged steps
    and no checkpoint (the resume starts again from step 0); the kill during a checkpoint leaves
    its temporary directory (the resume ignores it); the timed kill lands 37 % into the clean run's
    duration (seed 3's third draw), before the run ends. Every final policy.safetensors equals the
    clean run's bytes."""
    runs = chaos(3, seed=3, steps=3, workdir=tmp_path, moments=("before-checkpoint", "checkpoint-write", "time"))
    assert [r.identical for r in runs] == [True, True, True], runs
    before, writing, timed = runs
    assert re.search(r"logged=[12] checkpoints=-$", before.left), before
    assert "writing=.tmp_step_" in writing.left, writing
    assert timed.left != "finished" and timed.processes >= 2, timed
