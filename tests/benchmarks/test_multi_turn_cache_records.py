"""The README's and docs/tools.md's multi-turn sampling table from ``multi_turn_cache.jsonl`` records."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import multi_turn_cache  # noqa: E402


def record(run: str, seconds: dict[str, list[float]]) -> dict:
    return {"run": run, "episodes": 16, "max_new_tokens": 32, "threads": 1, "repeats": 3, "turns": [2, 3],
            "sampled_tokens": 402, "all_tokens": 3536, "seconds": seconds, "machine": "Box, 2 cores",
            "date": "2026-11-28", "commit": "abc1234"}


def test_medians_and_ratios_of_the_newest_run():
    """Newest run: medians 40, 44 and 90 s; ratios 44 / 40 = 1.10 and 90 / 40 = 2.25. The older run
    (a 10 s baseline) is not shown."""
    old = record("2026-11-27T10:00:00Z", {"single_turn": [10.0], "cache_kept": [11.0], "prefilled": [20.0]})
    new = record("2026-11-28T10:00:00Z", {"single_turn": [39.0, 40.0, 45.0], "cache_kept": [44.0, 43.0, 50.0],
                                         "prefilled": [90.0, 80.0, 95.0]})
    lines = multi_turn_cache.table([new, old]).splitlines()
    assert lines[2:5] == ["| one turn, the same sampled tokens | 40.0 | 1.00 |",
                          "| three turns, cache kept (the default) | 44.0 | **1.10** |",
                          "| three turns, the conversation prefilled every turn | 90.0 | 2.25 |"]
    assert lines[-1] == ("16 episodes of 2-3 messages, 402 sampled tokens, up to 32 a message; 1 thread(s), median "
                         "of 3; Box, 2 cores, 2026-11-28, commit abc1234.")


def test_no_record_names_the_command():
    assert "python benchmarks/multi_turn_cache.py" in multi_turn_cache.table([])
