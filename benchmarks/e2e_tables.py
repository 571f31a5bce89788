"""docs/performance.md's end-to-end tables from ``e2e_grpo.jsonl`` (``benchmarks/e2e_grpo.py``'s rows).

``comparison``: per mode, tether's and TRL's tokens/s and peak resident set over the timed steps,
with the tether / TRL ratios against the targets. ``phases``: the median seconds a step per phase.
Only full runs count (``--quick`` rows are smoke runs); per mode, and per variant of the workload
(natural lengths, TRL with gradient checkpointing), the newest run's rows are taken, and a ratio
is only taken between the tools' rows of that one run. A last line names each run read: machine,
date, commit, threads, workload and the command that records it. ``benchmarks/performance_tables.py`` places
them in the page; with no rows a table says which command records them.
"""

from __future__ import annotations

from typing import Any

SCRIPT = ".venv-bench/bin/python benchmarks/e2e_grpo.py"
EMPTY = (f"No end-to-end run is recorded yet in `benchmarks/results/e2e_grpo.jsonl`: `{SCRIPT}` records one "
         "(both tools, both modes), then `python benchmarks/tables.py` writes it here.")


def chosen(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the newest full run of each mode and variant, LoRA before full, tether before TRL."""
    from e2e_grpo import label

    full = [r for r in records if not r.get("quick")]
    newest: dict[str, str] = {}
    for r in full:
        newest[label(r)] = max(newest.get(label(r), ""), r["run"])
    order = {"lora": 0, "full": 1, "tether": 0, "trl": 1}
    return sorted((r for r in full if r["run"] == newest[label(r)]),
                  key=lambda r: (order[r["mode"]], label(r), order[r["tool"]]))


def command(rows: list[dict[str, Any]]) -> str:
    """The call that records a run like the one of ``rows`` (one run's rows)."""
    r = rows[0]
    flags = (f" --prompts {r['prompts']} --group {r['group']} --max-new-tokens {r['max_new_tokens']} "
             f"--threads {r['threads']} --steps {r['steps']} --warmup {r['warmup']}")
    flags += " --natural-lengths" * bool(r["natural_lengths"])
    flags += " --trl-gradient-checkpointing" * bool(r["trl_gradient_checkpointing"])
    modes = {x["mode"] for x in rows}
    flags += "" if modes == {"lora", "full"} else " --modes " + ",".join("LoRA" if m == "lora" else m for m in sorted(modes))
    flags += "" if any(x["tool"] == "trl" for x in rows) else " --no-trl"
    return SCRIPT + flags


def provenance(rows: list[dict[str, Any]]) -> str:
    """One sentence a run: where, when, at which commit, the workload, the versions and the command."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        runs.setdefault(r["run"], []).append(r)
    sentences = []
    for run, its in sorted(runs.items()):
        r = its[0]
        lengths = "answers ending at end-of-turn" if r["natural_lengths"] else "answers forced to the limit"
        trl = f", TRL {r['trl']}" if r.get("trl") else ""
        sentences.append(
            f"Run {run}: {r['machine']}, {r['date']}, commit {r['commit']}; {r['prompts']} prompts × {r['group']} "
            f"answers × {r['max_new_tokens']} new tokens ({lengths}), {r['threads']} thread(s), median of "
            f"{r['steps']} timed step(s) after {r['warmup']} warm-up; torch {r['torch']}{trl}. `{command(its)}`, then "
            "`python benchmarks/tables.py`.")
    return " ".join(sentences)


def _cell(r: dict[str, Any] | None, key: str, fmt: str, scale: float = 1.0) -> str:
    return "not run" if r is None else f"failed: {r['error']}" if "error" in r else fmt.format(r[key] / scale)


def comparison(records: list[dict[str, Any]]) -> str:
    """tether against TRL per mode: tokens/s, peak RSS in the timed steps, median step, and the ratios."""
    from _common import met
    from e2e_grpo import MEMORY_TARGET, TOKENS_TARGET, label, ratios

    rows = chosen(records)
    if not rows:
        return EMPTY
    by = {(label(r), r["tool"]): r for r in rows}
    lines = [f"| mode | tokens/s, tether / TRL | tether ÷ TRL (target ≥ {TOKENS_TARGET}×) | peak RSS in the timed "
             f"steps (MiB), tether / TRL | tether ÷ TRL (target ≤ {MEMORY_TARGET}×) | median step (s), tether / TRL |",
             "|---|---|---|---|---|---|"]
    for mode in dict.fromkeys(label(r) for r in rows):
        ours, theirs = by.get((mode, "tether")), by.get((mode, "trl"))
        both = ratios(ours, theirs)
        speed = "" if both is None else f"{both[0]:.2f}×, {'met' if met(both[0], TOKENS_TARGET, True) else 'missed'}"
        memory = "" if both is None else f"{both[1]:.2f}×, {'met' if met(both[1], MEMORY_TARGET, False) else 'missed'}"
        lines.append(f"| {mode} | {_cell(ours, 'tokens_per_s', '{:,.1f}')} / {_cell(theirs, 'tokens_per_s', '{:,.1f}')} "
                     f"| {speed} | {_cell(ours, 'peak_rss_bytes', '{:,.0f}', 2**20)} / "
                     f"{_cell(theirs, 'peak_rss_bytes', '{:,.0f}', 2**20)} | {memory} | "
                     f"{_cell(ours, 'median_step_s', '{:.2f}')} / {_cell(theirs, 'median_step_s', '{:.2f}')} |")
    return "\n".join(lines) + "\n\n" + provenance(rows)


def phases(records: list[dict[str, Any]]) -> str:
    """``e2e_grpo.phase_table`` of the rows ``comparison`` reads."""
    from e2e_grpo import phase_table

    rows = chosen(records)
    ran = [r for r in rows if "error" not in r]
    if not ran:
        return "No end-to-end run is recorded yet: the phases come with the rows of the table above."
    return phase_table(ran) + "\n\nMedian seconds a step (share of the step). " + provenance(rows)

