"""``benchmarks/logprobs.py``'s records: the row made from a measurement, the docs table built from
the newest full run (each pass's ratios to that run's naive row, tether's targets), a pass whose
naive row failed, and the empty case."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _results  # noqa: E402
import logprobs  # noqa: E402
from _common import Measurement  # noqa: E402

MIB = 2**20
WORKLOAD = {"quick": False, "batch": 16, "tokens": 256, "vocab": 49152, "hidden_size": 576, "dtype": "float32",
            "threads": 2, "repeats": 3, "warmup": 1, "torch": "2.13.0", "trl": "1.16.0",
            "command": "python benchmarks/logprobs.py", "machine": "box, 2 cores", "commit": "abc1234",
            "date": "2026-11-28"}
IMPL = {"naive": "naive", "tether (chunk 1024)": "tether", "trl selective_log_softmax": "trl"}


def _row(run: str, mode: str, variant: str, wall: float | None = None, cpu: float = 0.0, peak_mib: float = 0.0,
         **extra) -> dict:
    figures = {} if wall is None else {"median_s": wall, "times_s": [wall], "cpu_median_s": cpu,
                                       "peak_rss_growth_bytes": int(peak_mib * MIB), "peak_source": "VmHWM"}
    return {**WORKLOAD, "run": run, "mode": mode, "variant": variant, "impl": IMPL[variant],
            "chunk_size": 1024 if variant.startswith("tether") else 0, **figures, **extra}


NEW, FB = "2026-11-28T11:00:00Z", "forward+backward"
RECORDS = [
    _row("2026-11-28T10:00:00Z", "forward", "naive", 9.0, 9.0, 900),  # older: left out
    _row(NEW, "forward", "naive", 1.0, 2.0, 100), _row(NEW, "forward", "tether (chunk 1024)", 0.9, 1.9, 12),
    _row(NEW, "forward", "trl selective_log_softmax", 1.1, 2.2, 50),
    _row(NEW, FB, "naive", 3.0, 6.0, 200), _row(NEW, FB, "tether (chunk 1024)", 3.6, 6.3, 10),
    _row(NEW, FB, "trl selective_log_softmax", skipped="trl does not import"),
    _row("2026-11-28T12:00:00Z", "forward", "naive", 0.1, 0.1, 1, quick=True),  # newer smoke run: left out
]


def test_table_takes_the_newest_full_run_and_its_naive_rows():
    """Forward: tether 0.9 / 1.0 = 0.90x time (met, <= 1.1), CPU 1.9 / 2.0 = 0.95x, memory 12 / 100
    MiB = 0.120x (missed, > 0.1); TRL 1.10x, 1.10x, 0.500x, no targets. Forward+backward: tether
    3.6 / 3.0 = 1.20x (missed), 6.3 / 6.0 = 1.05x, 10 / 200 = 0.050x (met); TRL not installed."""
    lines = logprobs.table(RECORDS).splitlines()
    assert lines[:8] == [
        "| mode | implementation | median wall time (s) | time / naive | CPU time / naive | peak RSS growth (MiB) "
        "| memory / naive | time target | memory target |",
        "|---|---|---|---|---|---|---|---|---|",
        "| forward | naive | 1.000 | 1.00x | 1.00x | 100.0 | 1.000x |  |  |",
        "| forward | tether (chunk 1024) | 0.900 | 0.90x | 0.95x | 12.0 | 0.120x | met (<= 1.1x) | missed (<= 0.1x) |",
        "| forward | trl selective_log_softmax | 1.100 | 1.10x | 1.10x | 50.0 | 0.500x |  |  |",
        "| forward+backward | naive | 3.000 | 1.00x | 1.00x | 200.0 | 1.000x |  |  |",
        "| forward+backward | tether (chunk 1024) | 3.600 | 1.20x | 1.05x | 10.0 | 0.050x | missed (<= 1.1x) "
        "| met (<= 0.1x) |",
        "| forward+backward | trl selective_log_softmax | not installed |  |  |  |  |  |  |",
    ]
    assert lines[8:] == ["", "Run 2026-11-28T11:00:00Z: box, 2 cores, commit abc1234, 2026-11-28; B=16 T=256 V=49152 "
                         "H=576, float32, 2 threads, median of 3 after 1 warm-up; torch 2.13.0, trl 1.16.0; "
                         "`python benchmarks/logprobs.py`."]


def test_a_pass_whose_naive_row_failed_has_no_ratios():
    rows = [_row(NEW, "forward", "naive", error="benchmark child failed"),
            _row(NEW, "forward", "tether (chunk 1024)", 0.9, 1.9, 12)]
    assert logprobs.ratio_table(rows).splitlines()[2:] == [
        "| forward | naive | failed |  |  |  |  |  |  |",
        "| forward | tether (chunk 1024) | 0.900 |  |  | 12.0 |  |  |  |"]


def test_table_without_a_full_run_names_the_command():
    expected = ("No full run is recorded yet: `.venv-bench/bin/python benchmarks/logprobs.py` records one in "
                "`benchmarks/results/logprobs.jsonl`.")
    assert logprobs.table([]) == expected
    assert logprobs.table(RECORDS[-1:]) == expected


def test_measured_row_keeps_the_measurement_raw():
    m = Measurement(median_s=0.5, times_s=(0.6, 0.5, 0.4), cpu_median_s=0.9, peak_rss_growth_bytes=3 * MIB,
                    peak_source="VmHWM")
    assert logprobs.measured_row(FB, "tether (chunk 512)", "tether", 512, m) == {
        "mode": FB, "variant": "tether (chunk 512)", "impl": "tether", "chunk_size": 512, "median_s": 0.5,
        "times_s": [0.6, 0.5, 0.4], "cpu_median_s": 0.9, "peak_rss_growth_bytes": 3 * MIB, "peak_source": "VmHWM"}


def test_quick_records_only_where_results_is_given(tmp_path):
    assert logprobs.parse_args(["--quick"]).results is None
    assert logprobs.parse_args([]).results == _results.RESULTS
    assert logprobs.parse_args(["--quick", "--results", str(tmp_path)]).results == tmp_path


def test_chunk_sizes_must_be_positive_integers(capsys):
    assert logprobs.parse_args(["--chunk-sizes", "512, 1024"]).chunk_sizes == [512, 1024]
    for bad in ("512,x", "0", "512,,1024"):
        with pytest.raises(SystemExit):
            logprobs.parse_args(["--chunk-sizes", bad])
        assert f"--chunk-sizes: expected comma-separated positive integers such as 512,1024, got {bad!r}" in (
            capsys.readouterr().err)
