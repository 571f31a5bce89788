"""The leash page's paired tables (benchmarks/tables.py) from hand-made runs: which runs pair, and
the paired differences with their t intervals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import tables  # noqa: E402


def _run(seed: int, kls: list[float], scales: list[float], forwards: list[int], rewards: list[float],
         push: bool = False, setting: str = "lr 0.001, beta0 0.02, loss") -> dict:
    steps = [{"kl_exact_per_seq": k, "kl_per_seq": k, "kl_move_scale": s, "kl_move_forwards": f, "reward_mean": r}
             for k, s, f, r in zip(kls, scales, forwards, rewards)]
    return {"setting": setting, "seed": seed, "controller": "budget", "kl_push": push, "kl_target": 1.0,
            "steps": steps, "machine": "box", "commit": "abc1234", "date": "2026-11-28"}


def test_the_rate_that_follows_is_paired_with_the_plain_budget_on_setting_and_seed():
    """Eight steps (warm-up 1-4, scored 5-8), target 1. Seed 0: follow reads 1.0 at every scored step
    (4 of 4 in band), plain 1.0, 1.0, 2.0, 2.0 (2 of 4): +50 points. Seed 1: follow 3 of 4, plain 3
    of 4: 0. Mean +25, sd 35.36, t(1) 12.706: 25 +- 12.706 * 35.36 / sqrt 2 = 25 +- 317.7. Kept
    scale over steps 2-8: follow 0.9 throughout, plain 0.5: +0.40 with no spread. Readings a step:
    follow 2, plain 3. A push-on plain run and a follow run without a partner are left out."""
    ones, mixed = [1.0] * 8, [1.0] * 6 + [2.0, 2.0]
    three_of_four = [1.0] * 7 + [2.0]
    follow = [_run(0, ones, [0.9] * 8, [2] * 8, [0.1] * 8), _run(1, three_of_four, [0.9] * 8, [2] * 8, [0.1] * 8),
              _run(2, ones, [0.9] * 8, [2] * 8, [0.1] * 8, setting="lr 0.001, beta0 0.6, loss")]
    plain = [_run(0, mixed, [0.5] * 8, [3] * 8, [0.1] * 8), _run(1, three_of_four, [0.5] * 8, [3] * 8, [0.1] * 8),
             _run(0, ones, [1.0] * 8, [1] * 8, [0.1] * 8, push=True)]
    rows = {line.split(" | ")[1]: line for line in tables.lrfollow_comparison(follow, plain).splitlines()
            if line.startswith("| 2 |")}
    half = 12.706 * 35.3553390593 / 2 ** 0.5
    assert rows["steps 5-16 in band"] == (f"| 2 | steps 5-16 in band | 88 % | 62 % | 25 % ({25 - half:.0f} % to "
                                          f"{25 + half:.0f} %) |")
    assert rows["kept scale, steps 2-16, mean"].endswith("| 0.90 | 0.50 | 0.40 (0.40 to 0.40) |")
    assert rows["KL readings a step"].endswith("| 2.00 | 3.00 | -1.00 (-1.00 to -1.00) |")


def test_no_pair_says_which_command_records_them():
    assert "--lr-follow" in tables.lrfollow_comparison([], [])


@pytest.mark.parametrize("push", [True, False])
def test_the_push_table_pairs_on_and_off_through_the_same_mechanism(push):
    """One pair: on reads 1.0 at steps 5-8 (100 %), off 1, 1, 2, 2 (50 %): +50 with no interval
    (one pair); with the off run missing there is no pair."""
    on = _run(0, [1.0] * 8, [1.0] * 8, [1] * 8, [0.1] * 8, push=True)
    off = _run(0, [1.0] * 6 + [2.0, 2.0], [1.0] * 8, [1] * 8, [0.1] * 8, push=False)
    table = tables.push_comparison([on, off] if push else [on])
    if push:
        assert "| 1 | steps 5-16 in band | 100 % | 50 % | 50 % (nan % to nan %) |" in table
    else:
        assert "no run of the grid without the push yet" in table
