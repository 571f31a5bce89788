"""docs/tools.md's tool-run tables from a hand-made ``tool_run.jsonl`` record (the newest one read)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import tool_tables  # noqa: E402


def record(accuracy_after: float) -> dict:
    summary = {"accuracy_before": 0.34, "accuracy_after": accuracy_after, "accuracy_gain_points": 100 * (accuracy_after - 0.34),
               "eval_tool_call_rate_before": 0.42, "eval_tool_call_rate_after": 0.94, "eval_tool_error_rate_before": 0.0952,
               "eval_tool_error_rate_after": 0.0, "eval_kl_per_seq": 2.4947, "eval_kl_sampled_per_seq": 2.4404,
               "steps_over_kl_bound": 0, "steps_rejected": 0, "eval_size": 50, "seconds_in_steps": 428.5,
               "seconds_this_process": 617.2}
    step = {"step": 1, "reward_mean": 0.25, "tool_call_rate": 0.25, "tool_error_rate": 0.0, "kl_exact_per_seq": -1e-9,
            "kl_kept_per_seq": 0.004, "kl_move_scale": 1.0, "step_time": 36.2}
    return {"summary": summary, "steps": [step], "machine": "Box, 2 cores", "date": "2026-11-28", "commit": "abc1234"}


def test_heldout_reads_the_newest_record():
    """Newest record: 34 % -> 90 %, +56.0 points (the older one's 50 % is not shown)."""
    lines = tool_tables.heldout([record(0.5), record(0.9)]).splitlines()
    assert lines[0] == "| held-out set (50 products, greedy) | untrained | after 1 steps |"
    assert lines[2] == "| accuracy | 34.0 % | **90.0 %** (+56.0 points) |"
    assert lines[4] == "| calls that fail (malformed, bad arguments) | 0.10 | 0.00 |"
    assert lines[5].endswith("| 0 | 2.49 / 2.44 nats |")
    assert lines[-1].startswith("Box, 2 cores, 2026-11-28, commit abc1234; 428 s in the 1 steps, 617 s in the process")


def test_steps_show_an_exact_kl_of_zero_as_zero():
    """A KL of -1e-9 (rounding of an exact 0) reads 0.00, not -0.00."""
    lines = tool_tables.steps([record(0.9)]).splitlines()
    assert lines[5] == "| exact KL / answer of the step's batch | 0.00 |"
    assert lines[6] == "| the budget's landing (KL of the kept weights) | 0.00 |"


def test_no_record_names_the_command():
    assert tool_tables.COMMAND in tool_tables.heldout([]) and tool_tables.COMMAND in tool_tables.steps([])
