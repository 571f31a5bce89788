"""``benchmarks/scoring.py``'s table, from its records (``scoring.jsonl``, one row of the table a line).

The script prints ``body`` of the run it just made; docs/performance.md's ``scoring`` table is
``table`` over every record: the newest full (not ``--quick``) run in eager mode with the default
token budget, its rows as recorded (the medians over rounds of per-round ratios the script took),
and a last line naming the workload, the machine, the date, the commit and the command.
"""

from __future__ import annotations

from typing import Any

import _results
from _common import markdown_table, mib, verdict

HEADERS = ["entry point", "input", "wall (s)", "CPU (s)", "peak RSS growth (MiB)", "time ratio (wall)",
           "time ratio (CPU)", "time target", "memory ratio", "memory target", "against"]
COMMAND = ".venv-bench/bin/python benchmarks/scoring.py --ray-python .venv/bin/python"


def _row(r: dict[str, Any]) -> list[str]:
    if r.get("error"):
        return [r["label"], r["input"], f"failed: {r['error']}", *[""] * (len(HEADERS) - 3)]
    cells = [r["label"], r["input"], f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}", mib(r["peak_rss_growth_bytes"])]
    if r["tool"] == "torchrl":
        return cells + ["1.00x", "1.00x", "", "1.000x", "", ""]
    if r["wall_ratio"] is None:
        return cells + [""] * 6
    return cells + [f"{r['wall_ratio']:.2f}x", f"{r['cpu_ratio']:.2f}x", verdict(r["wall_ratio"], r["time_target"]),
                    f"{r['memory_ratio']:.3f}x", verdict(r["memory_ratio"], r["memory_target"]),
                    f"TorchRL {r['against']}"]


def rows(records: list[dict[str, Any]]) -> list[list[str]]:
    """The cells of one run's rows: tether's entry points in recorded order, then TorchRL's jobs."""
    return [_row(r) for r in sorted(records, key=lambda r: r["tool"] == "torchrl")]


def body(records: list[dict[str, Any]]) -> str:
    """One run's table, and where its peak memory was read from (what the script prints)."""
    sources = sorted({r["peak_source"] for r in records if r.get("peak_source")})
    return markdown_table(HEADERS, rows(records)) + f"\n\npeak memory read from: {', '.join(sources) or 'nothing'}"


def table(records: list[dict[str, Any]], compiled: bool = False) -> str:
    """The newest full run's table (``compiled``: the runs with ``--compile``), with its provenance."""
    run = _results.newest_run([r for r in records if r["compile"] == compiled and r["token_budget"] is None])
    if not run:
        return (f"No full{' `--compile`' if compiled else ''} run of `benchmarks/scoring.py` is recorded yet: "
                f"`{COMMAND}{' --compile --warmup 2' if compiled else ''}` records one in "
                "`benchmarks/results/scoring.jsonl`.")
    first = run[0]
    return (body(run) + f"; {first['chats']} chats ({first['min_tokens']}-{first['max_tokens']} tokens, seed "
            f"{first['seed']}), {first['model']} {first['dtype']}, median of {first['repeats']} calls after "
            f"{first['warmup']} warm-up per process, {first['rounds']} round(s), ratios paired within a round, "
            f"median over rounds; run {first['run']} on {first['machine']}, {first['date']}, commit {first['commit']}, "
            f"{first['threads']} thread(s), torch {first['torch']}, torchrl {first['torchrl']}: `{first['command']}`.")

