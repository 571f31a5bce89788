"""``tether cp``: a user copies a recipe, changes its algorithm, and runs the copy as printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.test_recipe import tiny_cfg
from tether.train import recipe, recipe_ray
from tether.train.cli import main

GRPO_LINE = "    policy = surrogate.loss\n"
# The user's change: plain REINFORCE on the advantages, -A * log pi per answer token.
REINFORCE_LINE = "    policy = -on_answers(rows.advantages) * logp\n"


def _flags(cfg) -> list[str]:
    return ["--quiet", *[f"{k}={v}" for k, v in cfg.__dict__.items()]]


def _step_one(program: list[str], cfg) -> dict:
    """Run ``program`` (a copy, or ``-m tether.train``) for ``cfg`` in a fresh process; its step-1 record."""
    done = subprocess.run([sys.executable, *program, *_flags(cfg)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    [row] = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    return row


def test_a_copy_with_another_loss_trains_with_that_loss(tmp_path, capsys):
    """The copy replaces the clipped GRPO surrogate by REINFORCE. Both runs start from the same
    weights and seed, so step 1 samples the same answers: rewards, lengths and entropy agree to
    the last bit. The loss differs: GRPO's on-policy surrogate is ``-A * r`` with the ratio
    ``r = exp(log pi - log pi_old) = 1`` (up to the sampler's numerics), REINFORCE's ``-A * log pi``.
    Their gradients agree: ``grad(-A * r) = -A * r * grad(log pi) = -A * grad(log pi)`` at
    ``r = 1``, so what ran is a REINFORCE loss: another value, the same gradient norm."""
    dest = tmp_path / "my_recipe.py"
    assert main(["cp", "recipe", str(dest)]) == 0
    assert dest.read_text() == Path(recipe.__file__).read_text()
    assert f"run it with: python {dest} [tether train flags]" in capsys.readouterr().out
    source = dest.read_text()
    assert source.count(GRPO_LINE) == 1
    dest.write_text(source.replace(GRPO_LINE, REINFORCE_LINE))
    cfg = dict(steps=1, checkpoint_every=0, eval_size=0)
    copied = _step_one([str(dest)], tiny_cfg(tmp_path / "copy", **cfg))
    shipped = _step_one(["-m", "tether.train"], tiny_cfg(tmp_path / "shipped", **cfg))
    for key in ("reward_mean", "reward_std", "response_length", "entropy"):
        assert copied[key] == shipped[key], key  # the same batch, scored by the same weights
    assert copied["loss"] != pytest.approx(shipped["loss"], rel=1e-3, abs=1e-4)
    assert copied["grad_norm"] == pytest.approx(shipped["grad_norm"], rel=1e-4)  # r = 1 up to ~1e-7


def test_the_unchanged_copy_trains_as_tether_train_does(tmp_path):
    """Without a change the copy is tether's recipe: step 1's loss and gradient norm are tether
    train's, bit for bit (the control of the test above)."""
    dest = tmp_path / "same.py"
    assert main(["cp", "recipe", str(dest)]) == 0
    cfg = dict(steps=1, checkpoint_every=0, eval_size=0)
    copied = _step_one([str(dest)], tiny_cfg(tmp_path / "copy", **cfg))
    shipped = _step_one(["-m", "tether.train"], tiny_cfg(tmp_path / "shipped", **cfg))
    assert (copied["loss"], copied["grad_norm"]) == (shipped["loss"], shipped["grad_norm"])


def test_a_ray_copy_is_a_program_that_asks_for_workers(tmp_path, capsys):
    """``tether cp recipe_ray`` writes a program with tether's loop inside: run as printed it
    needs ``--workers N``; without workers it says so (status 2) before anything is built."""
    dest = tmp_path / "my_ray.py"
    assert main(["cp", "recipe_ray", str(dest)]) == 0
    assert f"python {dest} --workers N [tether train flags]" in capsys.readouterr().out
    assert dest.read_text() == Path(recipe_ray.__file__).read_text()
    cfg = tiny_cfg(tmp_path / "run", steps=1)
    done = subprocess.run([sys.executable, str(dest), *_flags(cfg)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and not (tmp_path / "run").exists()
    assert done.stderr.strip() == ("tether train: workers=0: this recipe samples on Ray workers; pass --workers N "
                                   "(N >= 1), or run a copy of tether.train.recipe for one process.")


def test_cp_refuses_to_overwrite_without_force(tmp_path, capsys):
    dest = tmp_path / "mine.py"
    dest.write_text("# my own work\n")
    assert main(["cp", "recipe_ray", str(dest)]) == 2
    assert "mine.py: exists; pass --force" in capsys.readouterr().err
    assert dest.read_text() == "# my own work\n"
    assert main(["cp", "recipe_ray", str(dest), "--force"]) == 0
    assert "def ray_rollout" in dest.read_text()
