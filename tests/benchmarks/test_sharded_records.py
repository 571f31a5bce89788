"""``benchmarks/sharded.py``'s records and the scaling page's table, on hand-made records: the
newest full record of each (fine-tuning, ranks, threads), a failed row named, quick runs left out."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import sharded  # noqa: E402

STAMP = {"machine": "Box, 2 cores", "date": "2026-11-28", "commit": "abc1234", "torch": "2.13.0+cpu"}


def rank(i: int, steps_peak: float, life_peak: float) -> dict:
    return {"rank": i, "step_s": 1.0, "steps_peak_mib": steps_peak, "life_peak_mib": life_peak, "libraries_mib": 353.4}


def row(run: str, lora_rank: int, ranks: int, threads: int, step_s: float, peaks: list[float], **extra) -> dict:
    return {"run": run, "model": "default", "lora_rank": lora_rank, "ranks": ranks, "threads": threads, "steps": 4,
            "prompts": 4, "group": 4, "max_new_tokens": 16, "micro_batch": 8, "dtype": "float32", "quick": False,
            "command": "python benchmarks/sharded.py", "step_s": step_s,
            "per_rank": [rank(i, p, p + 0.4) for i, p in enumerate(peaks)], **STAMP, **extra}


def test_the_table_takes_the_newest_record_of_each_row_lora_first():
    """Rows: full 1x1 (run 2), LoRA 2x1 (older run 1 at 9.99 s, newer run 3 at 8.65 s), LoRA 1x1 (run 1),
    and a quick LoRA 1x1 of run 4 that must not replace it. Order: LoRA 1x1, LoRA 2x1, full 1x1.
    Peaks print as whole MiB: 2541.2 -> 2541, life 2541.6 -> 2542; libraries 353.4 -> 353."""
    records = [row("2026-11-28T10:00:00Z", 16, 1, 1, 7.824, [1791.0]),
               row("2026-11-28T10:00:00Z", 16, 2, 1, 9.99, [1.0, 2.0]),
               row("2026-11-28T11:00:00Z", 0, 1, 1, 11.27, [4270.0]),
               row("2026-11-28T12:00:00Z", 16, 2, 1, 8.654, [2541.2, 2622.0]),
               row("2026-11-28T13:00:00Z", 16, 1, 1, 0.1, [395.0], quick=True)]
    lines = sharded.table(records).splitlines()
    assert lines[2] == "| LoRA r16 | 1 x 1 | 7.82 | not recorded | 1791 | 1791 | 353 |"
    assert lines[3] == "| LoRA r16 | 2 x 1 | 8.65 | not recorded | 2541 / 2622 | 2542 / 2622 | 353 / 353 |"
    assert lines[4] == "| full | 1 x 1 | 11.27 | not recorded | 4270 | 4270 | 353 |"
    assert lines[5] == ""
    assert lines[6] == ("Model default, float32, 4 prompts x 4 answers x 16 tokens, median of steps 2-4 after one warm-up "
                        "step; Box, 2 cores, 2026-11-28, commit abc1234, torch 2.13.0+cpu; `python benchmarks/sharded.py`.")
    assert len(lines) == 7


def test_a_failed_row_is_shown_failed_with_its_error():
    records = [row("2026-11-28T10:00:00Z", 0, 2, 1, None, [], error="RuntimeError: gloo timed out")]
    assert sharded.table(records).splitlines()[2] == "| full | 2 x 1 | failed: RuntimeError: gloo timed out | | | | |"


def test_the_stage_split_reads_rank_0_and_derives_the_gather_on_two_ranks():
    """Rank 0 of 2: rollout 5.0 s of which sample 3.0 and reference 1.25, so the gather and release
    take 5.0 - 3.0 - 1.25 = 0.75 s; loss + optimizer 2.5, readings 1.125 (printed to 2 places: 1.12,
    round-half-even on the binary 1.125). One rank gathers nothing: its rollout is its sampling,
    and its reference pass is outside it (rollout 3.0 = sample 3.0, reference 1.0 -> gather 0.00)."""
    two = row("2026-11-28T10:00:00Z", 0, 2, 1, 9.0, [3700.0, 3710.0])
    two["per_rank"][0]["stage_s"] = {"rollout": 5.0, "sample": 3.0, "add_reference": 1.25, "optimize": 2.5,
                                     "hold_kl_budget": 1.125}
    one = row("2026-11-28T10:00:00Z", 0, 1, 1, 6.0, [5500.0])
    one["per_rank"][0]["stage_s"] = {"rollout": 3.0, "sample": 3.0, "add_reference": 1.0, "optimize": 1.5,
                                     "hold_kl_budget": 0.5}
    assert sharded.stages(two["per_rank"][0], 2) == "0.75 / 3.00 / 1.25 / 2.50 / 1.12"
    assert sharded.stages(one["per_rank"][0], 1) == "0.00 / 3.00 / 1.00 / 1.50 / 0.50"
    lines = sharded.table([one, two]).splitlines()
    assert lines[2] == "| full | 1 x 1 | 6.00 | 0.00 / 3.00 / 1.00 / 1.50 / 0.50 | 5500 | 5500 | 353 |"
    assert lines[3] == "| full | 2 x 1 | 9.00 | 0.75 / 3.00 / 1.25 / 2.50 / 1.12 | 3700 / 3710 | 3700 / 3710 | 353 / 353 |"


def test_no_full_record_names_the_commands():
    text = sharded.table([row("2026-11-28T13:00:00Z", 16, 1, 1, 0.1, [395.0], quick=True)])
    assert text.startswith("No run of `benchmarks/sharded.py` is recorded yet: on an idle machine, ")
    assert "`python benchmarks/sharded.py --lora-rank 0`" in text and "`python benchmarks/tables.py`" in text


def test_records_carry_the_workload_each_ranks_figures_and_a_failure():
    """A fabricated ``measure`` result for 1 rank and a failure for 2: one record each, the slowest
    rank's step and the per-rank figures unchanged, the failure as ``error`` with no figures."""
    args = sharded.parse_args(["--lora-rank", "0", "--threads", "2"])
    measured = {1: {"step_s": 7.24, "ranks": [rank(0, 4299.0, 4299.0)]}, 2: {"error": "RuntimeError: boom"}}
    one, two = sharded.records(args, measured, "2026-11-28T10:00:00Z", {"torch": "2.13.0+cpu"}, "python x")
    assert (one["ranks"], one["lora_rank"], one["threads"], one["step_s"], one["quick"]) == (1, 0, 2, 7.24, False)
    assert one["per_rank"] == [rank(0, 4299.0, 4299.0)] and "error" not in one
    assert (two["ranks"], two["step_s"], two["per_rank"], two["error"]) == (2, None, [], "RuntimeError: boom")
    assert one["run"] == two["run"] == "2026-11-28T10:00:00Z" and one["command"] == "python x"
    assert {"machine", "commit", "date", "torch"} <= one.keys()
