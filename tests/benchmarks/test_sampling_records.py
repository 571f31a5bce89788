"""``benchmarks/sampling.py``'s records: the row made from a measurement, the docs table built from
the newest full run (ratios and goal verdicts from that run's rows only), the empty case, and the
rows a run writes when an engine cannot run (llama_cpp missing) or fails (its process timed out)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _results  # noqa: E402
import sampling  # noqa: E402
from _common import Measurement  # noqa: E402

STAMP = {"machine": "box, 2 cores", "commit": "abc1234", "date": "2026-11-28"}
WORKLOAD = {"quick": False, "new_tokens": 20, "temperature": 1.0, "threads": 2, "repeats": 3, "warmup": 1,
            "torch": "2.13.0", "transformers": "4.57.0", "llama_cpp": "0.3.36",
            "command": "python benchmarks/sampling.py", **STAMP}


def _row(run: str, engine: str, prompts: int, group: int, speed: float | None = None, **extra) -> dict:
    figures = {} if speed is None else {"tokens_per_s": speed, "median_s": 1.0, "times_s": [1.0], "cpu_median_s": 2.0}
    return {**WORKLOAD, "run": run, "engine": engine, "prompts": prompts, "group": group, "batch": prompts * group,
            **figures, **extra}


NEW = "2026-11-28T11:00:00Z"
RECORDS = [
    # an older full run: every figure differs, none may show
    _row("2026-11-28T10:00:00Z", "tether", 1, 1, 1.0), _row("2026-11-28T10:00:00Z", "hf-generate", 1, 1, 9.0),
    _row(NEW, "tether", 1, 1, 30.0), _row(NEW, "hf-generate", 1, 1, 24.0), _row(NEW, "llama.cpp F16", 1, 1, 60.0),
    _row(NEW, "llama.cpp Q8_0", 1, 1, error="llama_decode failed on the prefill"),
    _row(NEW, "tether", 72, 1, 260.0), _row(NEW, "hf-generate", 72, 1, 200.0), _row(NEW, "llama.cpp F16", 72, 1, 130.0),
    _row(NEW, "llama.cpp Q8_0", 72, 1, skipped="llama_cpp does not import in python"),
    _row(NEW, "tether", 12, 6, 1200.0), _row(NEW, "hf-generate", 12, 6, 120.0),
    _row(NEW, "llama.cpp F16", 12, 6, skipped="llama_cpp does not import in python"),
    _row(NEW, "llama.cpp Q8_0", 12, 6, skipped="llama_cpp does not import in python"),
    # a newer smoke run: left out
    _row("2026-11-28T12:00:00Z", "tether", 2, 1, 5.0, quick=True),
]


def test_table_takes_the_newest_full_run_and_its_own_ratios():
    """Run 11:00 is the newest full one (10:00 is older, 12:00 is quick). Batch 1: 30 / 24 = 1.25x
    HF, 30 / 60 = 0.50x llama.cpp F16 (no verdict: the goals are at batch 72). Batch 72: 260 / 200 =
    1.30x < 2 (missed), 260 / 130 = 2.00x >= 0.5 (met). 12 x 6: 1200 / 120 = 10.00x, no F16 ratio
    (not installed). Q8_0 failed at batch 1 and was not installed at the others."""
    lines = sampling.table(RECORDS).splitlines()
    assert lines[:5] == [
        "| batch | tether (tokens/s) | hf-generate (tokens/s) | llama.cpp F16 (tokens/s) | llama.cpp Q8_0 (tokens/s) "
        "| tether / hf-generate | tether / llama.cpp F16 |",
        "|---|---|---|---|---|---|---|",
        "| 1 | 30.0 | 24.0 | 60.0 | failed | 1.25x | 0.50x |",
        "| 72 | 260.0 | 200.0 | 130.0 | not installed | 1.30x, missed (>= 2x) | 2.00x, met (>= 0.5x) |",
        "| 72 = 12 prompts × 6 | 1,200.0 | 120.0 | not installed | not installed | 10.00x |  |",
    ]
    assert lines[5:] == ["", "Run 2026-11-28T11:00:00Z: box, 2 cores, commit abc1234, 2026-11-28; 2 threads, 20 new "
                         "tokens a row at temperature 1, median of 3 after 1 warm-up; torch 2.13.0, transformers "
                         "4.57.0, llama_cpp 0.3.36; `python benchmarks/sampling.py`."]


def test_table_without_a_full_run_names_the_command():
    expected = ("No full run is recorded yet: `.venv-bench/bin/python benchmarks/sampling.py` records one in "
                "`benchmarks/results/sampling.jsonl`.")
    assert sampling.table([]) == expected
    assert sampling.table([r for r in RECORDS if r.get("quick")]) == expected


def test_measured_row_turns_the_measurement_into_tokens_per_second():
    """12 prompts x 6 = 72 rows x 20 new tokens in a median 0.5 s: 72 * 20 / 0.5 = 2880 tokens/s."""
    m = Measurement(median_s=0.5, times_s=(0.6, 0.5, 0.4), cpu_median_s=0.9, peak_rss_growth_bytes=7,
                    peak_source="VmHWM")
    assert sampling.measured_row("tether", 12, 6, 20, m) == {
        "engine": "tether", "prompts": 12, "group": 6, "batch": 72, "median_s": 0.5, "times_s": [0.6, 0.5, 0.4],
        "cpu_median_s": 0.9, "tokens_per_s": 2880.0}


def test_quick_records_only_where_results_is_given(tmp_path):
    assert sampling.parse_args(["--quick"]).results is None
    assert sampling.parse_args([]).results == _results.RESULTS
    assert sampling.parse_args(["--quick", "--results", str(tmp_path)]).results == tmp_path


def test_a_run_records_skipped_and_failed_rows(tmp_path, capsys):
    """llama.cpp under an interpreter where it cannot import: ``skipped`` rows; tether with a 1 ms
    process timeout: ``error`` rows. One ``run`` for all six, each with the workload and stamp."""
    sampling.main(["--quick", "--engines", "tether,llama.cpp F16", "--llama-python", "/bin/false",
                   "--timeout", "0.001", "--results", str(tmp_path)])
    rows = _results.read("sampling", tmp_path)
    assert [(r["engine"], r["prompts"], r["group"]) for r in rows] == [
        (e, p, g) for p, g in sampling.QUICK_LAYOUTS for e in ("tether", "llama.cpp F16")]
    assert len({r["run"] for r in rows}) == 1
    for r in rows:
        assert r["quick"] is True and r["new_tokens"] == 3 and r["llama_cpp"] is None and r["commit"]
        assert "tokens_per_s" not in r
        if r["engine"] == "tether":
            assert "timed out" in r["error"] and "skipped" not in r
        else:
            assert r["skipped"] == "llama_cpp does not import in /bin/false" and "error" not in r
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert table[0] == "| 1 | failed | not installed |  |"
