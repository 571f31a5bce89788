"""``benchmarks/estimators.py``: each variant's ``TrainConfig`` keys, the table's intervals derived by
hand, and a ``--quick`` run of two variants end to end into a results folder."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import estimators  # noqa: E402


def test_each_variant_sets_the_leash_form_it_names(tmp_path):
    args = estimators.parse_args(["--out", str(tmp_path), "--beta", "0.2"])
    got = {v: estimators.config(v, 3, args) for v in estimators.VARIANTS}
    forms = {v: (c.kl_mode, c.kl_estimator, c.kl_correction, c.trust_region, c.kl_controller) for v, c in got.items()}
    assert got["exact-loss"].kl_signal == "exact"
    assert forms == {
        "k1-reward": ("reward", "k1", "importance", "clip", "constant"),
        "k3-loss": ("loss", "k3", "none", "clip", "constant"),
        "k3-ratio": ("loss", "k3", "importance", "clip", "constant"),
        "k2-ratio": ("loss", "k2", "importance", "clip", "constant"),
        "exact-loss": ("exact", "k3", "importance", "clip", "constant"),
        "dppo-tv": ("loss", "k3", "importance", "dppo_tv", "constant"),
        "budget": ("loss", "k3", "importance", "clip", "budget"),
        "dppo-tv-budget": ("loss", "k3", "importance", "dppo_tv", "budget"),
    }
    assert all(c.kl_coef == 0.2 and c.seed == 3 and c.model == "default" for c in got.values())
    assert got["k3-loss"].out == str(tmp_path / "k3-loss-s3")


def test_unknown_variants_are_refused():
    with pytest.raises(SystemExit):
        estimators.parse_args(["--variants", "k3-loss,k4"])


def test_table_means_and_intervals_by_hand():
    """Accuracies 0.5 and 0.7: mean 60 %, sd 14.142, half-width t(1) 12.706 x 14.142 / sqrt 2 = 127.06.
    KLs 1 and 3: mean 2, half-width 12.706 x 1.4142 / 1.4142 = 12.706. Cut fractions 0, 0.5, 0.1, 0.2: 0.2.
    A third run on cuda is a row of its own: one seed, no interval (NaN bounds), its own cut mean."""
    cpu, cuda = {"device": "cpu"}, {"device": "cuda"}
    runs = [{"variant": "dppo-tv", "seed": 0, "config": cpu, "accuracy_after": 0.5, "eval_kl_sampled_per_seq": 1.0,
             "clip_fraction": [0.0, 0.5]},
            {"variant": "dppo-tv", "seed": 1, "config": cuda, "accuracy_after": 0.9, "eval_kl_sampled_per_seq": 0.5,
             "clip_fraction": [0.3]},
            {"variant": "dppo-tv", "seed": 3, "config": cpu, "accuracy_after": 0.7, "eval_kl_sampled_per_seq": 3.0,
             "clip_fraction": [0.1, 0.2]}]
    lines = estimators.table(runs)
    assert lines[2] == "| dppo-tv | cpu | 0, 3 | 60.0 [-67.1, 187.1] | 2.000 [-10.706, 14.706] | 0.200 |"
    assert lines[3] == "| dppo-tv | cuda | 1 | 90.0 [nan, nan] | 0.500 [nan, nan] | 0.300 |"
    assert len(lines) == 4


def test_quick_run_records_each_variant(tmp_path):
    results = tmp_path / "results"
    records = estimators.main(["--quick", "--variants", "k1-reward,dppo-tv-budget", "--seeds", "0", "--threads", "1",
                               "--out", str(tmp_path / "runs"), "--results", str(results)])
    assert [r["variant"] for r in records] == ["k1-reward", "dppo-tv-budget"]
    stored = [json.loads(line) for line in (results / "estimators.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["seed"]) for r in stored] == [("k1-reward", 0), ("dppo-tv-budget", 0)]
    for r in stored:
        assert r["config"]["model"] == "tiny" and r["config"]["steps"] == 2
        assert math.isfinite(r["eval_kl_sampled_per_seq"]) and r["eval_kl_sampled_per_seq"] >= 0
        assert 0 <= r["accuracy_after"] <= 1 and len(r["per_problem_after"]) == 4
        assert len(r["clip_fraction"]) == 2
    assert stored[1]["config"]["trust_region"] == "dppo_tv" and stored[0]["config"]["kl_mode"] == "reward"
