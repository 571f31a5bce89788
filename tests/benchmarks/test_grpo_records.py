"""benchmarks/grpo.py's records (grpo_loss.jsonl) and the docs table built from them: the record
of a fabricated measurement, hand-derived ratios from the rows of one run, which run the table
reads, a failed variant, and the empty case."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _results  # noqa: E402
import grpo  # noqa: E402
from _common import Measurement  # noqa: E402

MIB = 2**20
STAMP = {"machine": "Test CPU, 2 cores", "date": "2026-11-28", "commit": "abc1234"}


def _args(quick: bool = False) -> argparse.Namespace:
    return argparse.Namespace(quick=quick, repeats=3, warmup=1)


def _measured(wall: float, cpu: float, footprint_mib: float) -> tuple[Measurement, int]:
    m = Measurement(median_s=wall, times_s=(wall + 1, wall, wall - 1), cpu_median_s=cpu,
                    peak_rss_growth_bytes=int(footprint_mib * MIB) // 2, peak_source="VmHWM")
    return m, int(footprint_mib * MIB)


def _run(run: str, figures: dict, quick: bool = False) -> list[dict]:
    """A run's three records; ``figures``: variant -> (wall, cpu, footprint MiB) or an error."""
    size = grpo.QUICK if quick else grpo.FULL
    out = []
    for name, f in figures.items():
        result = f if isinstance(f, str) else _measured(*f)
        out.append({**grpo.record(run, name, result, size, _args(quick), "python benchmarks/grpo.py"), **STAMP})
    return out


def test_a_measurement_becomes_a_record_with_its_raw_figures():
    """tether x4 measured at 8.0 s wall (times 9, 8, 7), 10.0 s CPU, a 512 MiB footprint and a
    256 MiB growth: the record holds those numbers unformatted, 4 micro-batches, the workload and
    the targets, and survives a JSON round trip through ``_results``."""
    (r,) = _run("2026-11-28T10:00:00Z", {"tether x4": (8.0, 10.0, 512)})
    assert (r["variant"], r["micro_batches"], r["quick"]) == ("tether x4", 4, False)
    assert (r["median_s"], r["times_s"], r["cpu_median_s"]) == (8.0, [9.0, 8.0, 7.0], 10.0)
    assert (r["footprint_bytes"], r["peak_growth_bytes"], r["peak_source"]) == (512 * MIB, 256 * MIB, "VmHWM")
    assert (r["min_words"], r["max_words"], r["chats"], r["group"]) == (40, 190, 16, 4)
    assert (r["time_target"], r["memory_target"], r["kl_coeff"], r["entropy_coeff"]) == (0.5, 0.35, 0.1, 0.01)
    assert "error" not in r and {"torch", "torchrl", "threads", "repeats", "warmup"} <= set(r)


def test_records_replace_only_their_own_run_and_variant(tmp_path):
    """Two runs of three rows each: six lines; writing run 1's tether row again replaces it."""
    first = _run("r1", {"tether": (10.0, 12.0, 2048), "tether x4": (8.0, 10.0, 512), "torchrl": (20.0, 24.0, 8192)})
    second = _run("r2", {"tether": (11.0, 12.0, 2048), "tether x4": (9.0, 10.0, 512), "torchrl": (22.0, 24.0, 8192)})
    for r in first + second + [{**first[0], "median_s": 1.0}]:
        _results.write("grpo_loss", json.loads(json.dumps(r)), key=("run", "variant"), root=tmp_path)
    back = _results.read("grpo_loss", tmp_path)
    assert len(back) == 6
    assert [r["median_s"] for r in back if r["run"] == "r1" and r["variant"] == "tether"] == [1.0]


def test_a_failed_variant_is_recorded_with_its_error_and_no_figures():
    (r,) = _run("r", {"torchrl": "ModuleNotFoundError: No module named 'torchrl'"})
    assert r["error"] == "ModuleNotFoundError: No module named 'torchrl'"
    assert r["median_s"] is None and r["footprint_bytes"] is None and r["times_s"] is None


def test_the_table_takes_ratios_from_the_newest_full_run():
    """Newest full run r2: tether 10.0 s wall / 12.0 s CPU / 2,048 MiB, tether x4 8.0 / 10.0 / 512,
    TorchRL 20.0 / 24.0 / 8,192. Ratios: tether 10/20 = 0.50x wall (met: <= 0.5), 12/24 = 0.50x
    CPU, 2048/8192 = 0.25x footprint (met: <= 0.35); x4 8/20 = 0.40x, 10/24 = 0.4167 -> 0.42x,
    512/8192 = 0.0625 -> 0.06x. The older run r1 (TorchRL 40 s) and a newer quick run are left out."""
    records = (_run("2026-11-27T09:00:00Z", {"tether": (10.0, 12.0, 2048), "tether x4": (8.0, 10.0, 512),
                                             "torchrl": (40.0, 24.0, 8192)})
               + _run("2026-11-28T10:00:00Z", {"torchrl": (20.0, 24.0, 8192), "tether": (10.0, 12.0, 2048),
                                               "tether x4": (8.0, 10.0, 512)})
               + _run("2026-11-28T11:00:00Z", {"tether": (1.0, 1.0, 1), "torchrl": (9.0, 9.0, 9)}, quick=True))
    lines = grpo.table(records).splitlines()
    assert lines[2:5] == [
        "| tether | 10.0 | 11.0 10.0 9.0 | 12.0 | 2048.0 | 1024.0 | 0.50x | 0.50x | 0.25x | met (<= 0.5x) "
        "| met (<= 0.35x) |",
        "| tether x4 | 8.0 | 9.0 8.0 7.0 | 10.0 | 512.0 | 256.0 | 0.40x | 0.42x | 0.06x | met (<= 0.5x) "
        "| met (<= 0.35x) |",
        "| torchrl | 20.0 | 21.0 20.0 19.0 | 24.0 | 8192.0 | 4096.0 | 1.00x | 1.00x | 1.00x |  |  |",
    ]
    assert lines[5] == ""
    last = lines[6]
    assert "run 2026-11-28T10:00:00Z on Test CPU, 2 cores, 2026-11-28, commit abc1234" in last
    assert "median of 3 after 1 warm-up" in last and last.endswith("`python benchmarks/grpo.py`.")
    assert last.startswith(grpo.describe(grpo.FULL))


def test_a_missed_target_and_a_failed_peer_read_as_such():
    """tether at 12/20 = 0.60x wall misses the 0.5x target; without a TorchRL row no ratio is taken."""
    missed = grpo.rows(_run("r", {"tether": (12.0, 12.0, 4096), "torchrl": (20.0, 24.0, 8192)}))
    assert missed[0][6:] == ["0.60x", "0.50x", "0.50x", "missed (<= 0.5x)", "missed (<= 0.35x)"]
    failed = grpo.rows(_run("r", {"tether": (12.0, 12.0, 4096), "torchrl": "torchrl does not import"}))
    assert failed[0][6:] == [""] * 5
    assert failed[1] == ["torchrl", "failed: torchrl does not import", *[""] * 9]


def test_with_no_full_run_the_table_names_the_command():
    quick_only = _run("r", {"tether": (1.0, 1.0, 1)}, quick=True)
    expected = ("No full run of `benchmarks/grpo.py` is recorded yet: `.venv-bench/bin/python benchmarks/grpo.py` "
                "records one in `benchmarks/results/grpo_loss.jsonl`.")
    assert grpo.table([]) == grpo.table(quick_only) == expected


def test_a_quick_run_records_only_where_it_is_told(tmp_path):
    assert _results.destination(None, quick=True) is None
    assert _results.destination(None, quick=False) == _results.RESULTS
    assert _results.destination(tmp_path, quick=True) == tmp_path
