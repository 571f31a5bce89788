"""benchmarks/frontier.py --quick end to end on the tiny model: one record per (point, seed) with
SPEC section 13's keys, the forgetting axis and each held-out problem's correctness; best-of-n at
its analytic KL; a second call skips what is recorded; the time budget leaves jobs for later."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _results  # noqa: E402
import frontier  # noqa: E402

SPEC_KEYS = {"point", "seed", "kl_coef", "heldout_accuracy", "heldout_kl_sampled_per_seq", "train_kl_exact_per_seq",
             "steps", "per_problem"}
ALSO = {"forgetting_kl_sampled_per_seq", "capability_rate", "mode", "reduced", "commit", "machine", "date"}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("frontier")
    argv = ["--quick", "--only", "constant-0.1,best-of-n", "--seeds", "0", "--out", str(tmp / "runs"),
            "--results", str(tmp / "results")]
    assert frontier.main(argv) == 0
    return tmp, argv, {r["point"]: r for r in _results.read("frontier", tmp / "results")}


def test_each_record_has_the_spec_keys_and_one_verdict_per_heldout_problem(recorded):
    _, _, records = recorded
    assert set(records) == {"constant-0.1", "base", "best-of-n-1", "best-of-n-2", "best-of-n-4"}
    for r in records.values():
        assert SPEC_KEYS | ALSO <= set(r), r["point"]
        assert len(r["per_problem"]) == r["eval_size"] == frontier.MODES["quick"].eval_size
        assert set(r["per_problem"]) <= {0.0, 1.0} and r["heldout_accuracy"] == pytest.approx(
            sum(r["per_problem"]) / len(r["per_problem"]))
        assert r["mode"] == "quick" and r["reduced"] is True and r["seed"] == 0
    trained = records["constant-0.1"]
    assert trained["kl_coef"] == 0.1 and trained["steps"] == 2 and trained["heldout_kl_sampled_per_seq"] > 0
    assert trained["forgetting_kl_sampled_per_seq"] > 0 and 0 <= trained["capability_rate"] <= 1
    assert records["base"]["forgetting_kl_sampled_per_seq"] == 0.0  # the reference against itself


def test_a_record_lists_the_steps_whose_kept_weights_were_pulled_back(recorded, tmp_path):
    """Steps 1-3 of a hand-written log: step 1 kept as it was, step 2 pulled by the ceiling from 4.5
    to 3.6 at scale 0.894, step 3 pulled by the cumulative budget to 1.8 at 0.9; the quick run's
    record carries the two lists (its 2 steps at beta 0.1 pull nothing)."""
    rows = [{"step": 1, "kl_move_before_per_seq": 0.5, "kl_move_scale": 1.0, "kl_kept_per_seq": 0.5},
            {"step": 2, "kl_move_before_per_seq": 4.5, "kl_move_scale": 0.894, "kl_kept_per_seq": 3.6},
            {"step": 3, "kl_move_before_per_seq": 0.2, "kl_move_scale": 1.0, "kl_kept_per_seq": 0.2,
             "kl_to_base_scale": 0.9, "kl_to_base_per_seq": 1.8}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert frontier.pulled_steps(tmp_path) == {
        "pulled": [{"step": 2, "kl_before": 4.5, "scale": 0.894, "kl_kept": 3.6}],
        "pulled_to_base": [{"step": 3, "scale": 0.9, "kl_kept": 1.8}]}
    assert recorded[2]["constant-0.1"]["pulled"] == [] and recorded[2]["constant-0.1"]["pulled_to_base"] == []


def test_best_of_n_sits_at_the_analytic_kl_and_never_loses_accuracy_as_n_grows(recorded):
    """The draws are nested (the best of the first n), so a problem right at n stays right at 2n."""
    _, _, records = recorded
    for n in (1, 2, 4):
        assert records[f"best-of-n-{n}"]["heldout_kl_sampled_per_seq"] == pytest.approx(math.log(n) - (n - 1) / n)
    for small, large in ((1, 2), (2, 4)):
        a, b = records[f"best-of-n-{small}"]["per_problem"], records[f"best-of-n-{large}"]["per_problem"]
        assert all(x <= y for x, y in zip(a, b))


def test_a_second_call_skips_the_recorded_jobs_and_a_budget_leaves_the_rest(recorded, capsys):
    tmp, argv, _ = recorded
    assert frontier.plan(frontier.parse_args(argv), frontier.MODES["quick"], tmp / "results") == []
    args = frontier.parse_args(["--quick", "--only", "constant-0,constant-0.1,budget-t1", "--seeds", "0"])
    assert frontier.plan(args, frontier.MODES["quick"], tmp / "results") == [("constant-0", 0), ("budget-t1", 0)]
    # A budget shorter than one run: the first job runs, the second is left for a later call.
    budget = [*argv[:2], "constant-0,budget-t1", *argv[3:], "--budget-seconds", "0.5"]
    assert frontier.main(budget) == 0
    assert "1 jobs left for a later call" in capsys.readouterr().out
    assert {r["point"] for r in _results.read("frontier", tmp / "results")} >= {"constant-0"}


def test_every_point_s_config_validates_and_a_name_picks_its_point_alone():
    """Each point of the grid is a config tether train accepts (its fields exist and combine), in
    the quick mode and the full one; a point's own name picks only it, a prefix its family."""
    for name in ("quick", "full"):
        args = frontier.parse_args(["--quick"] if name == "quick" else [])
        for point, overrides in frontier.GRID.items():
            assert overrides is not None, point
            frontier._cfg(point, 0, frontier.MODES[name], args).validate()
    assert frontier.GRID["budget-avg-t2"]["weight_average"] == frontier.AVERAGE_DECAY
    assert frontier.GRID["full-budget-moving-t2"]["lora_rank"] == frontier.GRID["full-constant-0.1"]["lora_rank"] == 0
    assert "lora_rank" not in frontier.GRID["budget-moving-t2"]  # the default LoRA, on LoRA's curve
    assert frontier.selected("constant-0") == ["constant-0"]
    assert frontier.selected("constant-0-land") == [f"constant-0-land-t{t}" for t in (1, 2, 3, 4)]
    assert frontier.selected("budget-push") == [f"budget-push-t{t}" for t in (1, 2, 3, 4)]
    with pytest.raises(SystemExit, match="--only: 'beta' names no point"):
        frontier.selected("beta")


def test_seeds_take_ranges_and_a_malformed_list_is_refused_naming_the_flag(capsys):
    """``0,2,5-7`` is seeds 0, 2, 5, 6, 7 (a range includes both ends); a reversed range, a word or
    an empty part stop the call at parsing, naming --seeds and the part."""
    assert frontier.seed_list("0,2,5-7") == [0, 2, 5, 6, 7] and frontier.seed_list("8-8") == [8]
    for bad, part in (("3-1", "3-1"), ("0,x", "x"), ("0,,1", "")):
        with pytest.raises(SystemExit):
            frontier.parse_args(["--seeds", bad])
        assert f"--seeds: expected seeds and ranges like 0,2,5-7, got {bad!r} (part {part!r})" in capsys.readouterr().err
