"""benchmarks/scoring.py's records (scoring.jsonl, one row of its table a line) and
scoring_tables.py's docs table: records built from fabricated rounds with hand-derived per-round
ratios and medians, failures, which run the table reads, and the empty case."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import scoring  # noqa: E402
import scoring_tables  # noqa: E402
from _common import Measurement  # noqa: E402

MIB = 2**20
STAMP = {"machine": "Test CPU, 2 cores", "date": "2026-11-28", "commit": "abc1234"}


def _m(wall: float, cpu: float, peak_mib: float) -> Measurement:
    return Measurement(median_s=wall, times_s=(wall,), cpu_median_s=cpu, peak_rss_growth_bytes=int(peak_mib * MIB),
                       peak_source="VmHWM")


def _common(run: str, quick: bool = False, compile: bool = False) -> dict:
    args = argparse.Namespace(quick=quick, threads=2, repeats=2, warmup=1, rounds=2, compile=compile,
                              token_budget=None)
    return {**scoring.common_fields(16, args, run, "python benchmarks/scoring.py --rounds 2"), **STAMP}


def _two_rounds(ours_second=None, theirs=None) -> scoring.Rounds:
    """kl-tokens: 4.0 s then 5.0 s wall, 5.0 / 6.0 s CPU, 2 / 4 MiB; TorchRL's KL job 10.0 / 10.0 s
    wall, 10.0 / 12.0 s CPU, 1,000 MiB both rounds."""
    theirs = theirs or [{"kl": _m(10.0, 10.0, 1000)}, {"kl": _m(10.0, 12.0, 1000)}]
    return scoring.Rounds(theirs=theirs, ours=[{"kl-tokens": _m(4.0, 5.0, 2)},
                                               {"kl-tokens": ours_second or _m(5.0, 6.0, 4)}])


def test_records_hold_each_rounds_ratios_and_their_medians():
    """Per round: wall 4/10 = 0.4 and 5/10 = 0.5 (median 0.45), CPU 5/10 = 0.5 and 6/12 = 0.5
    (0.5), memory 2/1000 = 0.002 and 4/1000 = 0.004 (0.003). tether's medians 4.5 s wall, 5.5 s
    CPU, 3 MiB; TorchRL's row 10.0 s wall, 11.0 s CPU, 1,000 MiB."""
    ours, theirs = scoring.records(_two_rounds(), ["kl-tokens"], _common("r"))
    assert (ours["tool"], ours["entry"], ours["label"], ours["input"], ours["against"]) == (
        "tether", "kl-tokens", "RetrieveKL", "tokens", "kl")
    assert [round(p["wall"], 12) for p in ours["ratio_rounds"]] == [0.4, 0.5]
    assert [round(p["memory"], 12) for p in ours["ratio_rounds"]] == [0.002, 0.004]
    assert round(ours["wall_ratio"], 12) == 0.45 and ours["cpu_ratio"] == 0.5 and round(ours["memory_ratio"], 12) == 0.003
    assert (ours["wall_s"], ours["cpu_s"], ours["peak_rss_growth_bytes"]) == (4.5, 5.5, 3 * MIB)
    assert [p["median_s"] for p in ours["per_round"]] == [4.0, 5.0]
    assert (ours["time_target"], ours["memory_target"]) == (0.55, 0.45)
    assert (theirs["tool"], theirs["entry"], theirs["wall_s"], theirs["cpu_s"]) == ("torchrl", "kl", 10.0, 11.0)
    assert "error" not in ours and "error" not in theirs
    assert (ours["chats"], ours["min_tokens"], ours["max_tokens"], ours["rounds"]) == (16, 95, 240, 2)


def test_a_failed_round_makes_the_row_an_error_without_ratios():
    ours, _ = scoring.records(_two_rounds(ours_second="RuntimeError: boom"), ["kl-tokens"], _common("r"))
    assert ours["error"] == "RuntimeError: boom" and ours["wall_s"] is None and ours["wall_ratio"] is None
    assert ours["per_round"][1] == {"error": "RuntimeError: boom"}
    cells = scoring_tables.rows([{**ours}])[0]
    assert cells[:3] == ["RetrieveKL", "tokens", "failed: RuntimeError: boom"] and set(cells[3:]) == {""}


def test_torchrl_that_cannot_run_is_recorded_as_its_rows_error():
    """TorchRL asked for but not importable: its job row carries the reason, tether's row its own
    figures and no ratio."""
    why = "torchrl does not import in this interpreter"
    ours, theirs = scoring.records(_two_rounds(theirs=[{"kl": why}, {"kl": why}]), ["kl-tokens"], _common("r"))
    assert theirs["error"] == why and ours["wall_ratio"] is None and "error" not in ours
    assert scoring_tables.rows([ours, theirs])[0][5:] == [""] * 6


def test_without_torchrl_only_tethers_rows_are_recorded():
    rounds = scoring.Rounds(ours=[{"ref-tokens": _m(2.0, 2.0, 1)}])
    (only,) = scoring.records(rounds, ["ref-tokens"], _common("r"))
    assert only["tool"] == "tether" and only["ratio_rounds"] is None and only["wall_s"] == 2.0


def test_the_table_shows_the_newest_full_eager_run():
    """Run r2's rows as the records give them: 0.45x wall (met: <= 0.55), 0.50x CPU, 0.003x memory
    (met: <= 0.45), TorchRL's job last; the older r1, a newer --quick run and a newer --compile run
    are left out."""
    older = scoring.records(_two_rounds(ours_second=_m(9.0, 9.0, 9)), ["kl-tokens"], _common("2026-11-27T09:00:00Z"))
    chosen = scoring.records(_two_rounds(), ["kl-tokens"], _common("2026-11-28T10:00:00Z"))
    quick = scoring.records(_two_rounds(), ["kl-tokens"], _common("2026-11-28T11:00:00Z", quick=True))
    compiled = scoring.records(_two_rounds(), ["kl-tokens"], _common("2026-11-28T12:00:00Z", compile=True))
    lines = scoring_tables.table(older + list(reversed(chosen)) + quick + compiled).splitlines()
    assert lines[2:4] == [
        "| RetrieveKL | tokens | 4.50 | 5.50 | 3.0 | 0.45x | 0.50x | met (<= 0.55x) | 0.003x | met (<= 0.45x) "
        "| TorchRL kl |",
        "| TorchRL kl | chats | 10.00 | 11.00 | 1000.0 | 1.00x | 1.00x |  | 1.000x |  |  |",
    ]
    last = lines[5]
    assert last.startswith("peak memory read from: VmHWM; 16 chats (95-240 tokens, seed 0), SmolLM2-135M-Instruct")
    assert "2 round(s)" in last and "run 2026-11-28T10:00:00Z on Test CPU, 2 cores, 2026-11-28, commit abc1234, 2 " \
        "thread(s)" in last and last.endswith("`python benchmarks/scoring.py --rounds 2`.")
    assert scoring_tables.table(compiled, compiled=True).splitlines()[2].startswith("| RetrieveKL | tokens | 4.50 |")


def test_with_no_full_run_the_table_names_the_command():
    quick = scoring.records(_two_rounds(), ["kl-tokens"], _common("r", quick=True))
    expected = ("No full run of `benchmarks/scoring.py` is recorded yet: `.venv-bench/bin/python "
                "benchmarks/scoring.py --ray-python .venv/bin/python` records one in `benchmarks/results/scoring.jsonl`.")
    assert scoring_tables.table([]) == scoring_tables.table(quick) == expected
    assert scoring_tables.table(quick, compiled=True).startswith("No full `--compile` run of `benchmarks/scoring.py`")
