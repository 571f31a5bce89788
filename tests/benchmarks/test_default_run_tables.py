"""docs/leash.md's push table from hand-made ``default_run.jsonl`` records: a push-on and a push-off
run are paired only at one seed, commit and thread count, and the newest record of each side shows."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import default_run_tables  # noqa: E402


def record(push: bool, commit: str, threads: int, accuracy: float, seed: int = 0) -> dict:
    """Four steps at target 2: steps 3-4 read exact KLs 2.4 and 3.0, so 1 of 2 is in band (|2.4/2 - 1| = 0.2,
    |3.0/2 - 1| = 0.5); kept KLs 1.0, 2.0, 2.0, 2.3 (last three's mean 2.10); one kept scale over 1."""
    exact, kept, scale = [0.0, 1.0, 2.4, 3.0], [1.0, 2.0, 2.0, 2.3], [1.0, 4.0, 0.5, 1.0]
    steps = [{"kl_exact_per_seq": e, "kl_kept_per_seq": k, "kl_move_scale": s} for e, k, s in zip(exact, kept, scale)]
    summary = {"accuracy_after": accuracy, "eval_kl_sampled_per_seq": 2.104, "eval_kl_per_seq": 1.996,
               "steps_rejected": 0, "seconds_in_steps": 99.6}
    return {"seed": seed, "kl_push": push, "commit": commit, "config": {"kl_target": 2.0, "threads": threads},
            "summary": summary, "steps": steps, "machine": "Box, 2 cores", "date": "2026-11-28"}


def test_a_pair_needs_one_commit_and_thread_count_and_shows_the_newest_of_each_side():
    """Push on at aaa/1 (0.40 then the newer 0.52), off at aaa/1 (0.593) and off at bbb/0 (0.667,
    newest): only aaa/1 pairs, with 52.0 % against 59.3 %; bbb/0 has no push-on run, so no row."""
    records = [record(True, "aaa", 1, 0.40), record(True, "aaa", 1, 0.52), record(False, "aaa", 1, 0.593),
               record(False, "bbb", 0, 0.667)]
    lines = default_run_tables.push_pairs(records).splitlines()
    assert lines[2] == "| 0 | aaa, 1 | on | 52.0 % | 2.10 / 2.00 | 2.10 | 1 of 2 | 1 | 0 | 100 |"
    assert lines[3] == "| 0 | aaa, 1 | off | 59.3 % | 2.10 / 2.00 | 2.10 | 1 of 2 | 1 | 0 | 100 |"
    assert lines[4] == ""
    assert lines[5].startswith("Box, 2 cores, 2026-11-28; "
                               "`tether train --seed S --threads 1 --out runs/pS kl_push=true|false`")
    assert len(lines) == 6


def test_torchs_default_thread_count_is_named_and_seeds_come_in_order():
    """Seed 1 recorded first, seed 0 after: rows by seed; threads 0 reads as torch's default."""
    records = [record(True, "ccc", 1, 0.5, seed=1), record(False, "ccc", 1, 0.5, seed=1),
               record(True, "ddd", 0, 0.6), record(False, "ddd", 0, 0.7)]
    rows = default_run_tables.push_pairs(records).splitlines()[2:6]
    assert [row.split(" | ")[:3] for row in rows] == [["| 0", "ddd, torch's default", "on"],
                                                      ["| 0", "ddd, torch's default", "off"],
                                                      ["| 1", "ccc, 1", "on"], ["| 1", "ccc, 1", "off"]]


def test_no_pair_says_which_command_records_one():
    """A push-off run alone (the other side at another commit) pairs with nothing."""
    text = default_run_tables.push_pairs([record(False, "aaa", 1, 0.5), record(True, "bbb", 1, 0.5)])
    assert text.startswith("No seed recorded both with and without the push at one commit and thread count yet")
    assert "benchmarks/default_run.py" in text


def test_steps_in_band_counts_steps_three_on():
    """Steps 3-4 of the record: 2.4 / 2 within 25 %, 3.0 / 2 not: '1 of 2'."""
    assert default_run_tables.steps_in_band(record(True, "aaa", 1, 0.5)) == "1 of 2"
