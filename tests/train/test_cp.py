"""``tether cp``: a user copies a recipe, changes it, and runs the copy like ``tether train``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.train.test_recipe import tiny_cfg
from tether.train import recipe
from tether.train.cli import main


def test_a_copied_and_changed_recipe_runs_with_the_train_flags(tmp_path, capsys):
    dest = tmp_path / "my_recipe.py"
    assert main(["cp", "recipe", str(dest)]) == 0
    assert dest.read_text() == Path(recipe.__file__).read_text()
    assert "python " + str(dest) in capsys.readouterr().out
    # The user's change: one more metric per step.
    source = dest.read_text()
    assert source.count('"step": step + 1,') == 1
    dest.write_text(source.replace('"step": step + 1,', '"step": step + 1, "my_metric": 42.0,'))
    cfg = tiny_cfg(tmp_path / "run", steps=1, checkpoint_every=0)
    done = subprocess.run([sys.executable, str(dest), "--quiet", *[f"{k}={v}" for k, v in cfg.__dict__.items()]],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    [row] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["my_metric"] == 42.0 and row["step"] == 1


def test_cp_refuses_to_overwrite_without_force(tmp_path, capsys):
    dest = tmp_path / "mine.py"
    dest.write_text("# my own work\n")
    assert main(["cp", "recipe_ray", str(dest)]) == 2
    assert "mine.py: exists; pass --force" in capsys.readouterr().err
    assert dest.read_text() == "# my own work\n"
    assert main(["cp", "recipe_ray", str(dest), "--force"]) == 0
    assert "def ray_rollout" in dest.read_text()
