"""docs/performance.md's step-profile tables from ``step_profile.jsonl`` records (hand-made here)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import step_profile  # noqa: E402

STAMP = {"machine": "Box, 2 cores", "date": "2026-11-28", "commit": "abc1234"}


def record(run: str, seconds: float, dtype: str = "float32", ops: dict | None = None) -> dict:
    names = (*step_profile.STAGES, "rest", "step")
    stages = [{"stage": n, "seconds": 0.0, "gflop": 0.0} for n in names]
    stages[0] = {"stage": "sample", "seconds": seconds, "gflop": 100.0}
    stages[-1] = {"stage": "step", "seconds": 2 * seconds, "gflop": 100.0}
    return {"run": run, "model": "default", "dtype": dtype, "threads": 2, "ceiling_gflop_per_s": 200.0,
            "ceiling_shape": "[10, 4] @ [4, 12]", "stages": stages, **({"ops": ops} if ops else {}), **STAMP}


def test_stage_rows_are_the_newest_records_rates_against_its_own_ceiling():
    """Newest float32 record: sampling 100 GFLOP in 0.5 s = 200 GFLOP/s = 100 % of a 200 ceiling; the
    step 100 GFLOP in 1.0 s = 100 GFLOP/s = 50 %. The older record (2 s sampling) is not shown."""
    text = step_profile.table([record("r1", 2.0), record("r2", 0.5)])
    lines = text.splitlines()
    assert lines[2] == "| sampling (prefill and decode) | 0.50 | 100.0 | 200 | 100 % |"
    assert lines[3] == "| rewards | 0.00 | 0 |  |  |"
    assert lines[9] == "| **step** | **1.00** | **100.0** | **100** | **50 %** |"
    assert "2.00" not in text
    assert text.endswith("default model, float32, threads: 2, ceiling 200 GFLOP/s (`[10, 4] @ [4, 12]` float32); "
                         "Box, 2 cores, 2026-11-28, commit abc1234.")


def test_one_table_per_dtype():
    text = step_profile.table([record("r1", 1.0), record("r2", 1.0, dtype="bfloat16")])
    assert text.index("default model, bfloat16") < text.index("default model, float32")


def test_ops_table_rate_is_the_stage_gflop_over_its_matmul_seconds():
    """sampling: 100 GFLOP over 0.25 s of matrix products = 400 GFLOP/s; other ops 0.30 s."""
    ops = {"sample": {"matmul_s": 0.25, "other_s": 0.3, "largest_other_s": [["cat", 0.2], ["mul", 0.1]]}}
    text = step_profile.ops_table([record("r1", 1.0, ops=ops), record("r2", 1.0)])
    assert text.splitlines()[2] == "| sampling | 0.25 | 400 | 0.30 | cat 0.20, mul 0.10 |"


def test_empty_records_name_the_command():
    assert step_profile.COMMAND in step_profile.table([])
    assert step_profile.COMMAND in step_profile.ops_table([record("r1", 1.0)])
