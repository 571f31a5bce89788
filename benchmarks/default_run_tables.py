"""docs/leash.md's table of the default run with and without the push (``default_run.jsonl``).

A comparison of two runs says something only when nothing else differs between them: the table
pairs a push-on and a push-off record of one seed only when they ran at the same commit and the
same thread count, and shows the newest record of each side of every such pair.
``benchmarks/tables.py`` places it in the page.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import _results

BAND = 0.25  # a step is in band when its exact KL lies within +-25 % of the target
COMMAND = ("`tether train --seed S --threads 1 --out runs/pS kl_push=true|false`, each run recorded by "
           "`python benchmarks/default_run.py runs/pS`")


def pairs(records: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(push on, push off)`` per (seed, commit, threads) recorded both ways, the newest record of
    each side (records are appended in time order), by seed, then by the pair's newest record."""
    sides: dict[tuple, dict[bool, tuple[int, dict[str, Any]]]] = {}
    for i, r in enumerate(records):
        key = (r["seed"], r["commit"], r["config"]["threads"])
        sides.setdefault(key, {})[bool(r.get("kl_push", True))] = (i, r)
    both = [(key, s) for key, s in sides.items() if len(s) == 2]
    both.sort(key=lambda ks: (ks[0][0], max(ks[1][True][0], ks[1][False][0])))
    return [(s[True][1], s[False][1]) for _, s in both]


def steps_in_band(run: dict[str, Any]) -> str:
    """``'<k> of <n>'``: how many of steps 3 on had their batch's exact KL in the band."""
    late = run["steps"][2:]
    return f"{sum(abs(x['kl_exact_per_seq'] / run['config']['kl_target'] - 1) <= BAND for x in late)} of {len(late)}"


def _threads(r: dict[str, Any]) -> str:
    return str(r["config"]["threads"] or "torch's default")


def push_pairs(records: list[dict[str, Any]]) -> str:
    """The default run with and without the push: one row a side of each pair (``pairs``)."""
    found = pairs(records)
    if not found:
        return f"No seed recorded both with and without the push at one commit and thread count yet ({COMMAND})."
    rows = ["| seed | commit, threads | push | held-out accuracy after | held-out KL, sampled / greedy "
            "| kept KL, last 3 steps | steps 3-16 in band | kept scale > 1 | rejected | seconds in steps |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for on, off in found:
        for push, r in (("on", on), ("off", off)):
            s, steps = r["summary"], r["steps"]
            rows.append(f"| {r['seed']} | {r['commit']}, {_threads(r)} | {push} | {100 * s['accuracy_after']:.1f} % "
                        f"| {s['eval_kl_sampled_per_seq']:.2f} / {s['eval_kl_per_seq']:.2f} "
                        f"| {statistics.fmean(x['kl_kept_per_seq'] for x in steps[-3:]):.2f} "
                        f"| {steps_in_band(r)} | {sum(x['kl_move_scale'] > 1 for x in steps)} "
                        f"| {s.get('steps_rejected', 0)} | {s['seconds_in_steps']:.0f} |")
    stamps = sorted({(r["machine"], r["date"]) for pair in found for r in pair})
    return "\n".join(rows) + "\n\n" + "; ".join(f"{m}, {d}" for m, d in stamps) + f"; {COMMAND}."


TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "default-run-push": ("docs/leash.md", lambda: push_pairs(_results.read("default_run"))),
}
