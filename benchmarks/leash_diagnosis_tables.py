"""docs/leash.md's tables of where the leash's misses come from: a batch's KL noise at fixed weights
(``leash_noise.jsonl``, ``leash_noise.py``) and the diagnosed runs' log-ratio spreads
(``leash_reading.jsonl``, ``leash_reading.py``). ``benchmarks/tables.py`` places them in the page.
"""

from __future__ import annotations

from typing import Any, Callable

import _results

PAGE = "docs/leash.md"


def leash_noise(records: list[dict[str, Any]]) -> str:
    """Fixed weights, fresh batches: the spread of a batch's KL and the in-band ceiling it sets, at
    the run's batch size and at 2 and 4 times it (``leash_noise.py``'s pooled batches)."""
    from leash_noise import ceilings, pooled

    if not records:
        return "No run measured yet (`python benchmarks/leash_noise.py RUN --pools 1,2,4 --record`)."
    lines = ["| run (final weights) | batches of 24 | answers a batch | sd of log KL | in band, landed on one batch |",
             "|---|---|---|---|---|"]
    for r in records:
        for k in (1, 2, 4):
            c = ceilings(pooled(r["batch_kls"], k))
            lines.append(f"| {r['run']} | {len(r['batch_kls'])} | {k * r['answers']} | {c['sd_log']:.2f} "
                         f"| {c['aimed_at_one_batch']:.0%} |")
    stamps = sorted({(r["machine"], r["commit"], r["date"]) for r in records})
    return "\n".join(lines) + "\n\n" + "; ".join(f"{m}, commit {c}, {d}" for m, c, d in stamps) + "."


def leash_reading(records: list[dict[str, Any]]) -> str:
    """Where a miss comes from, per diagnosed run: the sd over steps 5-16 of each log ratio."""
    from leash_reading import spreads

    if not records:
        return "No run diagnosed yet (`python benchmarks/leash_reading.py`)."
    lines = ["| setting | seed | the miss: own answers, new prompts / kept reading | off-policy reading: own answers, "
             "same prompts / kept reading | new prompts and draws | importance-weighted reading's error |",
             "|---|---|---|---|---|---|"]
    for r in records:
        sd = spreads(r)
        lines.append(f"| {r['setting']} | {r['seed']} | {sd['miss']:.2f} | {sd['off_policy']:.2f} "
                     f"| {sd['new_prompts']:.2f} | {sd['importance_weighted']:.2f} |")
    stamps = sorted({(r["machine"], r["commit"], r["date"]) for r in records})
    return "\n".join(lines) + "\n\n" + "; ".join(f"{m}, commit {c}, {d}" for m, c, d in stamps) + "."


TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "leash-noise": (PAGE, lambda: leash_noise(_results.read("leash_noise"))),
    "leash-reading": (PAGE, lambda: leash_reading(_results.read("leash_reading"))),
}
