"""benchmarks/e2e_grpo.py's rows and docs/performance.md's end-to-end tables (e2e_tables.py) from
hand-made records: the row built from a measurement, which run the tables read, the ratios, what a
failed or missing tool and an empty file give, and where a run's rows go."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _results  # noqa: E402
import e2e_grpo  # noqa: E402
import e2e_tables  # noqa: E402
from _common import Measurement  # noqa: E402

MIB = 2**20
SETUP = {"model": "default", "device": "CPU", "dtype": "float32", "prompts": 4, "group": 4, "max_new_tokens": 16,
         "micro_batch_size": 16, "threads": 2, "natural_lengths": False, "trl_gradient_checkpointing": False,
         "steps": 3, "warmup": 1, "quick": False, "torch": "2.13.0+cpu", "trl": "1.16.0", "transformers": "5.23.0",
         "peft": "0.18.0"}
PHASES = {"sampling": 1.5, "scoring": 0.5, "loss": 2.5, "optimizer": 0.5}


def _row(run: str, tool: str, mode: str, tokens_per_s: float | None, peak_mib: float | None, **extra) -> dict:
    row = {"run": run, "tool": tool, "mode": mode, **SETUP, "median_step_s": 880 / tokens_per_s if tokens_per_s else None,
           "step_times_s": [4.0], "cpu_s": 7.0, "tokens_per_step": 880, "tokens_per_s": tokens_per_s,
           "mean_completion_tokens": 16.0, "peak_rss_bytes": peak_mib * MIB if peak_mib else None,
           "lifetime_rss_bytes": 5000 * MIB, "phases_s": PHASES, "threads_seen": [2],
           "machine": "Intel Xeon, 2 cores", "commit": "abc1234", "date": "2026-11-28", **extra}
    return {k: v for k, v in row.items() if v is not None}


def _run(run: str, scale: float = 1.0, **extra) -> list[dict]:
    return [_row(run, "tether", "lora", 200.0 * scale, 2048, **extra), _row(run, "trl", "lora", 125.0, 4096, **extra),
            _row(run, "tether", "full", 150.0 * scale, 3072, **extra), _row(run, "trl", "full", 100.0, 4096, **extra)]


def _body(table: str) -> list[str]:
    return [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| mode")]


def test_the_row_carries_summarise_figures_of_a_measurement():
    """Step records of 100 and 120 tokens: median 110; the median step 2.0 s gives 110 / 2.0 = 55.0
    tokens/s; mean completion (3 + 5) / 2 = 4.0; the peaks are the last timed step's (VmHWM 300 MiB,
    ru_maxrss 500 MiB); each phase's median of the two steps, e.g. sampling (1.0 + 2.0) / 2 = 1.5."""
    steps = [{"tokens": 100, "mean_completion": 3.0, "hwm": 200 * MIB, "ru_maxrss": 400 * MIB, "threads": 2,
              "phases": {"sampling": 1.0, "scoring": 0.25, "loss": 0.5, "optimizer": 0.25}},
             {"tokens": 120, "mean_completion": 5.0, "hwm": 300 * MIB, "ru_maxrss": 500 * MIB, "threads": 2,
              "phases": {"sampling": 2.0, "scoring": 0.75, "loss": 1.5, "optimizer": 0.25}}]
    m = Measurement(median_s=2.0, times_s=(1.5, 2.0, 2.5), cpu_median_s=3.5, peak_rss_growth_bytes=0,
                    peak_source="VmHWM")
    row = e2e_grpo.record("2026-11-28T14:00:00Z", "TRL", "LoRA", SETUP, {"m": m, "records": steps})
    stamp = {k: row.pop(k) for k in ("machine", "commit", "date")}
    assert stamp == _results.stamp()
    assert row == {"run": "2026-11-28T14:00:00Z", "tool": "trl", "mode": "lora", **SETUP, "median_step_s": 2.0,
                   "step_times_s": [1.5, 2.0, 2.5], "cpu_s": 3.5, "tokens_per_step": 110.0, "tokens_per_s": 55.0,
                   "mean_completion_tokens": 4.0, "peak_rss_bytes": 300 * MIB, "lifetime_rss_bytes": 500 * MIB,
                   "phases_s": {"sampling": 1.5, "scoring": 0.5, "loss": 1.0, "optimizer": 0.25}, "peak_rss_source": "VmHWM",
                   "phase_detail_s": {}, "threads_seen": [2]}


def test_tether_rows_carry_the_median_of_its_phase_split():
    """tether's steps split their phases (readings 0.5 and 1.5 s: median 1.0); TRL's do not (above)."""
    steps = [{"tokens": 100, "mean_completion": 3.0, "hwm": 1, "ru_maxrss": 1, "threads": 2,
              "phases": dict.fromkeys(e2e_grpo.PHASES, 1.0), "phase_detail": {"readings": r, "loss_forward": 0.5}}
             for r in (0.5, 1.5)]
    m = Measurement(median_s=4.0, times_s=(4.0,), cpu_median_s=8.0, peak_rss_growth_bytes=0, peak_source="VmHWM")
    row = e2e_grpo.record("r", "tether", "LoRA", SETUP, {"m": m, "records": steps})
    assert row["phase_detail_s"] == {"readings": 1.0, "loss_forward": 0.5}


def test_a_failed_variant_is_recorded_with_its_error_and_no_figures():
    row = e2e_grpo.record("r", "tether", "full", SETUP, {"error": "RuntimeError: boom", "detail": "long stderr"})
    assert row["error"] == "RuntimeError: boom" and (row["tool"], row["mode"]) == ("tether", "full")
    assert not {"tokens_per_s", "peak_rss_bytes", "phases_s", "detail"} & set(row)


def test_the_settings_name_the_workload_and_the_versions():
    """A --quick run: 2 x 2 x 4 tokens, 1 timed step after 1 warm-up; the versions installed here."""
    import torch

    args = e2e_grpo.parse_args(["--quick", "--threads", "1"])
    work = {"prompts": 2, "group": 2, "max_new_tokens": 4, "threads": 1, "steps": 2, "natural_lengths": False,
            "trl_gradient_checkpointing": False}
    setup = e2e_grpo.settings(args, work, 4)
    assert {k: setup[k] for k in ("prompts", "group", "max_new_tokens", "micro_batch_size", "threads", "steps",
                                  "warmup", "quick", "torch")} == {
        "prompts": 2, "group": 2, "max_new_tokens": 4, "micro_batch_size": 4, "threads": 1, "steps": 1, "warmup": 1,
        "quick": True, "torch": torch.__version__}
    assert set(setup) >= {"trl", "transformers", "peft", "natural_lengths", "trl_gradient_checkpointing"}


def test_a_quick_run_records_only_where_results_is_given(tmp_path):
    assert e2e_grpo.results_dir(e2e_grpo.parse_args([])) == _results.RESULTS
    assert e2e_grpo.results_dir(e2e_grpo.parse_args(["--quick"])) is None
    assert e2e_grpo.results_dir(e2e_grpo.parse_args(["--quick", "--results", str(tmp_path)])) == tmp_path


def test_the_comparison_reads_the_newest_full_run_and_takes_ratios_within_it():
    """Run r2: LoRA 200 / 125 tokens/s = 1.60x (met, >= 1.2x) at 2,048 / 4,096 MiB = 0.50x (met,
    <= 0.7x); full 150 / 100 = 1.50x at 3,072 / 4,096 = 0.75x (missed). Median step 880 / 200 = 4.40 s,
    880 / 125 = 7.04 s, 880 / 150 = 5.87 s, 880 / 100 = 8.80 s. r1 (older, tether 3x faster) and r3
    (newer but --quick) are left out."""
    quick = [{**r, "quick": True} for r in _run("r3", scale=9.0)]
    table = e2e_tables.comparison(_run("r1", scale=3.0) + _run("r2") + quick)
    assert _body(table) == [
        "| LoRA | 200.0 / 125.0 | 1.60×, met | 2,048 / 4,096 | 0.50×, met | 4.40 / 7.04 |",
        "| full | 150.0 / 100.0 | 1.50×, met | 3,072 / 4,096 | 0.75×, missed | 5.87 / 8.80 |"]
    assert table.splitlines()[-1] == (
        "Run r2: Intel Xeon, 2 cores, 2026-11-28, commit abc1234; 4 prompts × 4 answers × 16 new tokens (answers "
        "forced to the limit), 2 thread(s), median of 3 timed step(s) after 1 warm-up; torch 2.13.0+cpu, TRL 1.16.0. "
        "`.venv-bench/bin/python benchmarks/e2e_grpo.py --prompts 4 --group 4 --max-new-tokens 16 --threads 2 "
        "--steps 3 --warmup 1`, then `python benchmarks/tables.py`.")


def test_a_variant_run_is_its_own_row_and_does_not_hide_the_default_one():
    """r2 ran with --natural-lengths after r1: both runs' LoRA rows stay, each paired within its run
    (r1 200 / 125 = 1.60x, r2 2 x 200 / 125 = 3.20x), and the command names the flag."""
    rows = _run("r1")[:2] + _run("r2", scale=2.0, natural_lengths=True)[:2]
    table = e2e_tables.comparison(rows)
    assert [line.split(" | ")[:3] for line in _body(table)] == [
        ["| LoRA", "200.0 / 125.0", "1.60×, met"], ["| LoRA (natural lengths)", "400.0 / 125.0", "3.20×, met"]]
    assert "--natural-lengths --modes LoRA`" in table and table.count("Run r") == 2


def test_a_failed_or_missing_tool_is_named_and_gets_no_ratio():
    rows = [_row("r", "tether", "lora", 200.0, 2048), _row("r", "trl", "lora", None, None, error="not installed: trl"),
            _row("r", "tether", "full", 150.0, 3072)]
    body = _body(e2e_tables.comparison(rows))
    assert body == ["| LoRA | 200.0 / failed: not installed: trl |  | 2,048 / failed: not installed: trl |  "
                    "| 4.40 / failed: not installed: trl |",
                    "| full | 150.0 / not run |  | 3,072 / not run |  | 5.87 / not run |"]


def test_the_phase_table_is_the_printed_one_of_the_same_rows():
    """Phases 1.5 / 0.5 / 2.5 / 0.5 s of a 5.0 s step: 30 %, 10 %, 50 %, 10 %; the older run r1
    and a failed row are left out."""
    rows = (_run("r1")[:2] + [_row("r2", "tether", "lora", 200.0, 2048, phase_detail_s={"readings": 0.25})]
            + [_row("r2", "trl", "lora", None, None, error="boom")])
    table = e2e_tables.phases(rows)
    assert _body(table) == ["| LoRA | tether | 1.50 (30%) | 0.50 (10%) | 2.50 (50%) | 0.50 (10%) | 0.25 |"]
    assert "Run r2:" in table and "Run r1" not in table and "--modes LoRA`" in table


def test_no_full_run_gives_the_command_that_records_one():
    quick = [{**r, "quick": True} for r in _run("r")]
    assert e2e_tables.comparison([]) == e2e_tables.comparison(quick) == e2e_tables.EMPTY
    assert "benchmarks/e2e_grpo.py" in e2e_tables.EMPTY
    assert e2e_tables.phases(quick).startswith("No end-to-end run is recorded yet")


def test_the_printed_table_gives_the_tether_line_its_ratios_and_verdicts():
    """The same r2 rows as the comparison: 1.60x met (>= 1.2x), 0.50x met (<= 0.7x); TRL's line none."""
    lines = _body(e2e_grpo.main_table(_run("r2")[:2]))
    assert lines[0].endswith("| 1.60x met (>= 1.2x) | 0.50x met (<= 0.7x) |")
    assert lines[1].startswith("| LoRA | TRL | 7.04 |") and lines[1].endswith("|  |  |")
