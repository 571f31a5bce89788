"""docs/gpu.md's tables (benchmarks/gpu_tables.py) from hand-made records, and largest_model.py's
choices: which rows count, which run is the newest, the ratios, what an empty table says, the
order of sizes and what counts as running out of memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_tables  # noqa: E402
import largest_model  # noqa: E402

GIB = 2**30


def _row(run: str, tool: str, tokens: float | None, peak: float | None, **extra) -> dict:
    return {"run": run, "bench": "step", "model": "llama-1b", "mode": "full", "tool": tool, "device": "NVIDIA H200",
            "tokens_per_s": tokens, "peak_gpu_memory_bytes": peak, "phases_s": {"sampling": 0.5, "loss": 1.25},
            "date": "2026-12-01", "commit": "abc1234", "prompts": 16, "group": 8, "max_new_tokens": 128, **extra}


def test_the_step_table_pairs_the_newest_run_and_takes_ratios_within_it():
    """Newest run r2: tether 12,000 tokens/s at 10 GiB, TRL 6,000 at 20 GiB: 2.00x and 0.50x
    (10 GiB = 10,240 MiB). The older run r1 (a 9x ratio) and a CPU smoke row are left out."""
    rows = [_row("r1", "tether", 9000.0, GIB), _row("r1", "trl", 1000.0, GIB),
            _row("r2", "tether", 12000.0, 10 * GIB), _row("r2", "trl", 6000.0, 20 * GIB),
            {**_row("r3", "tether", 5.0, None), "device": "CPU"}]
    table = gpu_tables.steps(rows)
    body = [line for line in table.splitlines() if line.startswith("| llama-1b")]
    assert body == ["| llama-1b | full | 12,000 / 6,000 | 2.00× | 10,240 / 20,480 | 0.50× | NVIDIA H200 "
                    "| 2026-12-01, abc1234 |"]
    phases = gpu_tables.phases(rows)
    assert "| llama-1b | full | tether | 0.50 | 1.25 |" in phases and "r1" not in phases
    assert phases.splitlines()[0] == "| model | mode | tool | sampling | loss |"


def test_a_checkpointing_run_is_its_own_row_and_does_not_hide_the_plain_one():
    """Run r2 (both tools with --gradient-checkpointing) is newer than r1 (without): each keeps its
    row, r2's ratios 8,000 / 5,000 = 1.60x and 4 / 8 GiB = 0.50x, r1's 12,000 / 6,000 = 2.00x."""
    rows = [_row("r1", "tether", 12000.0, 10 * GIB), _row("r1", "trl", 6000.0, 20 * GIB),
            _row("r2", "tether", 8000.0, 4 * GIB, gradient_checkpointing=True),
            _row("r2", "trl", 5000.0, 8 * GIB, gradient_checkpointing=True)]
    body = [line for line in gpu_tables.steps(rows).splitlines() if line.startswith("| llama-1b")]
    assert [line.split(" | ")[:4] for line in body] == [
        ["| llama-1b", "full", "12,000 / 6,000", "2.00×"],
        ["| llama-1b (checkpointing)", "full", "8,000 / 5,000", "1.60×"]]
    assert "| llama-1b (checkpointing) | full | tether | 0.50 | 1.25 |" in gpu_tables.phases(rows)


def test_a_failed_tool_is_named_and_gets_no_ratio():
    rows = [_row("r", "tether", 12000.0, 10 * GIB), _row("r", "trl", None, None, error="not installed: trl")]
    (line,) = [x for x in gpu_tables.steps(rows).splitlines() if x.startswith("| llama-1b")]
    assert "failed: not installed: trl" in line and "×" not in line


def test_empty_tables_say_which_command_records_them():
    assert "No GPU step is recorded yet" in gpu_tables.steps([]) and "gpu_check.sh" in gpu_tables.steps([])
    assert "--stages install,largest-model" in gpu_tables.largest([_row("r", "tether", 1.0, 1.0)])
    dry = {"stage": "train", "status": "ran", "device": "CPU", "dry_run": True, "figures": {}}
    assert gpu_tables.checks([dry]).startswith("No GPU check is recorded yet")


def test_the_check_table_reads_the_newest_gpu_record_of_each_stage():
    old = {"stage": "nccl", "status": "failed", "reason": "exit status 1", "device": "NVIDIA H200, 580, 143771 MiB",
           "date": "2026-12-01", "commit": "a", "figures": {}}
    new = {**old, "status": "ran", "date": "2026-12-02", "commit": "b", "reason": None,
           "figures": {"backend": "nccl", "world_size": 1, "parameters_compared": 21, "matches_unsharded": True}}
    table = gpu_tables.checks([old, new])
    assert ("| nccl | ran | nccl, 1 rank(s): loss and 21 gradients match the unsharded model: yes "
            "| NVIDIA H200, 580, 143771 MiB | 2026-12-02, b |") in table
    assert "| train | not recorded | | | |" in table


def _search(tool: str, size: str, fits: bool | None, tokens: float | None = None, peak: float | None = None) -> dict:
    return {**_row("s", tool, tokens, peak), "bench": "largest-model", "size": size, "fits": fits,
            "error": None if fits else "torch.OutOfMemoryError: CUDA out of memory.", "memory_cap_mib": None,
            "parameters": {"1b": 1, "3b": 3, "8b": 8}[size], "max_new_tokens": 256}


def test_the_largest_model_table_orders_sizes_and_compares_where_both_fit():
    """At 1b both fit: 3,000 / 1,500 tokens/s = 2.00x, 30 / 60 GiB = 0.50x; at 3b TRL runs out of
    memory (no ratio); 8b: tether out of memory, TRL never tried (its ladder stopped at 3b)."""
    rows = [_search("tether", "1b", True, 3000.0, 30 * GIB), _search("trl", "1b", True, 1500.0, 60 * GIB),
            _search("tether", "8b", False), _search("tether", "3b", True, 1000.0, 80 * GIB), _search("trl", "3b", False)]
    lines = [x for x in gpu_tables.largest(rows).splitlines() if x.startswith("| NVIDIA")]
    assert [x.split(" | ")[2] for x in lines] == ["1b", "3b", "8b"]
    assert lines[0].endswith("| 3,000 tokens/s, 30,720 MiB | 1,500 tokens/s, 61,440 MiB | 2.00× | 0.50× |")
    assert "does not fit: torch.OutOfMemoryError" in lines[1] and "×" not in lines[1]
    assert lines[2].split(" | ")[4] == "not tried"


def test_out_of_memory_is_told_from_other_failures():
    assert largest_model.fits({"tokens_per_s_per_gpu": 1.0}) is True
    assert largest_model.fits({"error": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"}) is False
    assert largest_model.fits({"error": "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried"}) is False
    assert largest_model.fits({"error": "ValueError: size: expected one of"}) is None
    assert largest_model.fits({"error": "Command '[...]' timed out after 30 seconds"}) is None


def test_an_attempt_is_estimated_from_the_last_scaled_by_parameters():
    """3b after 1b took 40 s: 40 x 2.97e9 / 1.07e9 = 110.6 s; none before: least_s."""
    assert largest_model.estimate("3b", ("1b", 40.0), 60.0) == pytest.approx(40.0 * 2969742336 / 1073809408)
    assert largest_model.estimate("1b", None, 60.0) == 60.0


def test_sizes_out_of_order_or_unknown_are_refused(capsys):
    with pytest.raises(SystemExit):
        largest_model.parse_args(["--sizes", "3b,1b"])
    assert "increasing order" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        largest_model.parse_args(["--sizes", "1b,70b"])
    assert "--sizes: expected a comma-separated subset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        largest_model.parse_args(["--memory-cap-mib", "0"])
    assert largest_model.parse_args(["--tools", "TRL", "--modes", "LoRA"]).tools == ["TRL"]


def test_no_attempt_starts_that_the_budget_cannot_cover(tmp_path):
    """A 30 s budget against the first attempt's estimate of --least-s 60 s: no model is built,
    no row is written, and each tool and mode is listed as not started for the budget."""
    args = largest_model.parse_args(["--device", "cpu", "--sizes", "tiny", "--tools", "tether", "--budget-seconds",
                                     "30", "--model-root", str(tmp_path), "--record", str(tmp_path / "rows.jsonl")])
    report = largest_model.search(args, "CPU")
    assert report["rows"] == [] and not (tmp_path / "rows.jsonl").exists() and list(tmp_path.iterdir()) == []
    assert report["not_started"] == [{"tool": "tether", "mode": m, "size": "tiny", "reason": "budget"}
                                     for m in ("full", "LoRA")]
