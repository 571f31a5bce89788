"""Rebuild the docs' leash tables and plots from the raw records in ``benchmarks/results/``.

A table lives in its page between ``<!-- table:NAME -->`` and ``<!-- /table -->``; this script
writes what the records give there (and the plots beside the pages). ``--check`` writes nothing
and exits 1 when a page's table differs from what the records give, naming it.

    python benchmarks/tables.py            # rebuild every table and plot
    python benchmarks/tables.py --check    # fail when a docs table is stale
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402
from _stats import interval  # noqa: E402
import default_run_tables  # noqa: E402
import estimators  # noqa: E402
import frontier_tables  # noqa: E402
import gpu_tables  # noqa: E402
import leash_diagnosis_tables  # noqa: E402
import performance_tables  # noqa: E402
import sharded  # noqa: E402
import tool_tables  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BAND = default_run_tables.BAND  # a step is in band when its KL lies within +-25 % of the target
GOAL_IN_BAND, GOAL_PEAK = 0.8, 1.5
WARM = 4  # steps 1-4 are the warm-up: scored are steps 5 on


# ------------------------------------------------------------------------------ numbers
def scored(run: dict[str, Any]) -> list[float]:
    """The scored steps' KL over the target: the exact KL of each step's batch, steps 5 on."""
    kls = [s.get("kl_exact_per_seq", s["kl_per_seq"]) for s in run["steps"]]
    return [kl / run["kl_target"] for kl in kls[WARM:]]


def in_band(run: dict[str, Any]) -> float:
    ratios = scored(run)
    return sum(abs(r - 1) <= BAND for r in ratios) / len(ratios)


def misses(run: dict[str, Any]) -> tuple[int, int, int]:
    """The scored steps out of band, by where the weights that read them had been kept: their own
    reading (``kl_kept_per_seq``, the step before) under the band, in it, or over it. A miss after
    a landing in the band is the new batch's (its prompts and draws); one after a landing under it
    is a KL the budget let lag (no push, or a search that fell short)."""
    steps, target = run["steps"], run["kl_target"]
    counts = [0, 0, 0]
    for before, step in zip(steps[WARM - 1:], steps[WARM:]):
        if abs(step.get("kl_exact_per_seq", step["kl_per_seq"]) / target - 1) <= BAND:
            continue
        kept = before["kl_kept_per_seq"] / target - 1
        counts[0 if kept < -BAND else 2 if kept > BAND else 1] += 1
    return counts[0], counts[1], counts[2]


def spread_ceiling(run: dict[str, Any]) -> float:
    """The in-band share a perfect landing would get: each scored step's KL over the KL its weights
    had been kept at on the step before (``kl_exact_per_seq[t] / kl_kept_per_seq[t-1]``, the same
    weights read on a new batch) is the factor the new batch alone applies; a landing exactly on
    the target scores in band when that factor lies within the band."""
    steps = run["steps"]
    factors = [s.get("kl_exact_per_seq", s["kl_per_seq"]) / before["kl_kept_per_seq"]
               for before, s in zip(steps[WARM - 1:], steps[WARM:]) if before["kl_kept_per_seq"] > 0]
    return sum(abs(f - 1) <= BAND for f in factors) / len(factors)


def meets_goal(run: dict[str, Any]) -> bool:
    return in_band(run) >= GOAL_IN_BAND and max(scored(run)) <= GOAL_PEAK


# ------------------------------------------------------------------------------ tables
def leash_grid(runs: list[dict[str, Any]], push: bool) -> str:
    """The budget's grid at one ``kl_push``: one row per setting, its seeds side by side."""
    runs = [r for r in runs if r["controller"] == "budget" and r["kl_push"] == push]
    settings = list(dict.fromkeys(r["setting"] for r in sorted(runs, key=_setting_order)))
    lines = ["| setting | seeds | steps 5-16 in band, per seed | largest KL / target, per seed | misses after a "
             "landing under / in / over the band | in band at a perfect landing (the new batch's spread) | kept over `kl_bound` "
             "| rejected | goal met |", "|---|---|---|---|---|---|---|---|---|"]
    for name in settings:
        rows = sorted((r for r in runs if r["setting"] == name), key=lambda r: r["seed"])
        bands = " / ".join(f"{in_band(r):.0%}" for r in rows)
        peaks = " / ".join(f"{max(scored(r)):.2f}" for r in rows)
        over = sum(bool(s.get("kl_over_bound")) for r in rows for s in r["steps"])
        rejected = sum(bool(s.get("step_rejected")) for r in rows for s in r["steps"])
        met = sum(meets_goal(r) for r in rows)
        cause = [misses(r) for r in rows]
        causes = " / ".join(str(sum(c[i] for c in cause)) for i in range(3))
        ceiling = " / ".join(f"{spread_ceiling(r):.0%}" for r in rows)
        lines.append(f"| {name} | {', '.join(str(r['seed']) for r in rows)} | {bands} | {peaks} | {causes} | {ceiling} | {over} "
                     f"| {rejected} | {met} of {len(rows)} |")
    return "\n".join(lines)


def push_comparison(runs: list[dict[str, Any]]) -> str:
    """Push on against off on the same (setting, seed): the paired differences with 95 % intervals."""
    budget = {(r["setting"], r["seed"], r["kl_push"]): r for r in runs if r["controller"] == "budget"}
    pairs = [(budget[s, seed, True], budget[s, seed, False]) for s, seed, push in budget
             if push and (s, seed, False) in budget]
    if not pairs:
        return "| pairs | |\n|---|---|\n| 0 | no run of the grid without the push yet |"
    return _paired(pairs, ("push on", "push off", "on − off"), PAIRED_MEASURES)


def lrfollow_comparison(follow: list[dict[str, Any]], plain: list[dict[str, Any]]) -> str:
    """``kl_adaptive_lr`` against the plain budget (push off) on the same (setting, seed)."""
    base = {(r["setting"], r["seed"]): r for r in plain if r["controller"] == "budget" and not r["kl_push"]}
    pairs = [(r, base[r["setting"], r["seed"]]) for r in follow if (r["setting"], r["seed"]) in base]
    if not pairs:
        return ("No paired run yet (`python benchmarks/leash.py --controllers budget --push off --lr-follow "
                "--settings 3,4,7 --seeds 0,1,2 --threads 1`).")
    measures = [*PAIRED_MEASURES,
                ("kept scale, steps 2-16, mean", lambda r: statistics.fmean(s["kl_move_scale"] for s in r["steps"][1:]), "{:.2f}"),
                ("KL readings a step", lambda r: statistics.fmean(s["kl_move_forwards"] for s in r["steps"]), "{:.2f}")]
    stamps = sorted({(r["machine"], r["commit"], r["date"]) for pair in pairs for r in pair})
    return (_paired(pairs, ("rate follows", "plain budget", "follows − plain"), measures) + "\n\n"
            + "; ".join(f"{m}, commit {c}, {d}" for m, c, d in stamps) + ".")


def _paired(pairs: list[tuple[dict, dict]], names: tuple[str, str, str],
            measures: list[tuple[str, Callable[[dict], float], str]]) -> str:
    """A row a measure: both sides' means and their paired difference with its 95 % t interval."""
    lines = [f"| paired runs (setting, seed) | measure | {names[0]} | {names[1]} | {names[2]} (95 % interval) |",
             "|---|---|---|---|---|"]
    for label, f, fmt in measures:
        one, two = [f(a) for a, _ in pairs], [f(b) for _, b in pairs]
        mean, low, high = interval([a - b for a, b in zip(one, two)])
        lines.append(f"| {len(pairs)} | {label} | {fmt.format(statistics.fmean(one))} | {fmt.format(statistics.fmean(two))} "
                     f"| {fmt.format(mean)} ({fmt.format(low)} to {fmt.format(high)}) |")
    return "\n".join(lines)


def _reward_gain(run: dict[str, Any]) -> float:
    rewards = [s["reward_mean"] for s in run["steps"]]
    tail = rewards[-max(len(rewards) // 4, 1):]
    return statistics.fmean(tail) - rewards[0]


def _setting_order(run: dict[str, Any]) -> tuple:
    return (run["kl_mode"] != "loss" or run["kl_coef"] < 0.01, run["kl_mode"], run["learning_rate"], run["kl_coef"])


PAIRED_MEASURES: list[tuple[str, Callable[[dict], float], str]] = [
    ("steps 5-16 in band", lambda r: 100 * in_band(r), "{:.0f} %"),
    ("largest KL / target, steps 5-16", lambda r: max(scored(r)), "{:.2f}"),
    ("KL / target at step 5", lambda r: scored(r)[0], "{:.2f}"),
    ("reward gain (last 4 steps − step 1)", lambda r: _reward_gain(r), "{:+.3f}"),
]


def grid_provenance(runs: list[dict[str, Any]]) -> str:
    """Where and when the grid's runs ran, from their records."""
    budget = [r for r in runs if r["controller"] == "budget"]
    if not budget:
        return "No run recorded yet."
    stamps = sorted({(r["machine"], r["commit"], r["date"]) for r in budget})
    where = "; ".join(f"{m}, commit {c}, {d}" for m, c, d in stamps)
    shape = budget[0]
    return (f"{len(budget)} runs of {shape['prompts']} prompts x {shape['group']} answers of up to "
            f"{shape['max_new_tokens']} tokens, {len(shape['steps'])} steps, `kl_target` {shape['kl_target']:g}, "
            f"`kl_bound` {shape['kl_bound']:g}, {shape['threads']} thread(s) each: {where}.")


def leash_toy(rows: list[dict[str, Any]]) -> str:
    """The budget on the toy plant: push on and off, and what Adam's moments do after a move."""
    lines = ["| lr | push | Adam after a move | steps 5-16 in band, mean (worst run) | final reward / scale "
             "| largest KL / target | rejected |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["lr"], not r["push"], r["moments"] != "keep", r["moments"])):
        lines.append(f"| {r['lr']:g} | {'on' if r['push'] else 'off'} | {r['moments']} | {r['in_band_mean']:.0%} "
                     f"({r['in_band_worst']:.0%}) | {r['reward_over_scale']:.3f} | {r['peak_over_target']:.2f} "
                     f"| {r['rejected']} |")
    stamps = sorted({(r["machine"], r["commit"], r["date"]) for r in rows})
    return "\n".join(lines) + "\n\n" + "; ".join(f"{m}, commit {c}, {d}" for m, c, d in stamps) + (
        f"; {rows[0]['runs']} runs a row." if rows else "")


def _newest(records: list[dict[str, Any]], push: bool | None = None) -> list[dict[str, Any]]:
    """The newest record of each seed at ``kl_push`` (the default's when None), by seed."""
    if push is None:
        from tether.train.config import TrainConfig

        push = TrainConfig.kl_push
    newest: dict[int, dict[str, Any]] = {}
    for r in records:  # appended in time order
        if r.get("kl_push", True) == push:
            newest[r["seed"]] = r
    return [newest[k] for k in sorted(newest)]


def default_run_heldout(records: list[dict[str, Any]]) -> str:
    """The default run, each recorded seed a column: held-out results and the leash's counts."""
    runs = _newest(records)
    if not runs:
        return "No default run recorded yet (`make train && python benchmarks/default_run.py`)."
    head = "| | " + " | ".join(f"seed {r['seed']}" for r in runs) + " |"
    rows = [head, "|---|" + "---|" * len(runs)]

    def line(label: str, cell: Callable[[dict], str]) -> None:
        rows.append(f"| {label} | " + " | ".join(cell(r) for r in runs) + " |")

    line("held-out accuracy before → after (greedy)",
         lambda r: f"{100 * r['summary']['accuracy_before']:.1f} % → **{100 * r['summary']['accuracy_after']:.1f} %**")
    line("held-out exact KL per answer: sampled at the training temperature / greedy answers",
         lambda r: f"{r['summary']['eval_kl_sampled_per_seq']:.2f} / {r['summary']['eval_kl_per_seq']:.2f}")
    line("kept weights' KL per answer, last 3 steps (target 3)",
         lambda r: f"{statistics.fmean(s['kl_kept_per_seq'] for s in r['steps'][-3:]):.2f}")
    line("steps 3-16 whose batch read within ±25 % of the target",
         default_run_tables.steps_in_band)
    line("kept weights over `kl_bound` / rejected updates",
         lambda r: f"{r['summary']['steps_over_kl_bound']} / {r['summary'].get('steps_rejected', 0)}")
    line("leash readings: count, share of the step time",
         lambda r: f"{int(sum(s.get('kl_move_forwards', 0) for s in r['steps']))}, "
                   f"{sum(s.get('kl_move_seconds', 0) for s in r['steps']) / sum(s['step_time'] for s in r['steps']):.1%}")
    line("seconds in steps", lambda r: f"{r['summary']['seconds_in_steps']:.0f}")
    line("recorded at", lambda r: f"{r['commit']}, {r['date']}")
    machines = sorted({r["machine"] for r in runs})
    return "\n".join(rows) + "\n\nMachine: " + "; ".join(machines) + "."


def default_run_steps(records: list[dict[str, Any]]) -> str:
    """Seed 0's steps: the exact KL of each batch, the scale kept, beta."""
    runs = [r for r in _newest(records) if r["seed"] == 0]
    if not runs:
        return "No seed-0 default run recorded yet."
    steps = runs[0]["steps"]
    quarters = [steps[i:i + 4] for i in range(0, len(steps), 4)]
    rows = ["| steps | " + " | ".join(f"{q[0]['step']}-{q[-1]['step']}" for q in quarters) + " |",
            "|---|" + "---|" * len(quarters)]
    for label, key, fmt in (("exact KL / answer of the batch", "kl_exact_per_seq", "{:.2f}"),
                            ("kept weights' KL / answer", "kl_kept_per_seq", "{:.2f}"),
                            ("scale kept", "kl_move_scale", "{:.2g}"), ("β", "kl_coef", "{:.2f}")):
        rows.append(f"| {label} | " + " | ".join(", ".join(fmt.format(s[key]) for s in q) for q in quarters) + " |")
    return "\n".join(rows)


TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    **leash_diagnosis_tables.TABLES,
    "leash-toy": ("docs/leash.md", lambda: leash_toy(_results.read("leash_toy"))),
    "default-run": ("docs/getting-started.md", lambda: default_run_heldout(_results.read("default_run"))),
    "home-default-run": ("docs/index.md", lambda: default_run_heldout(_results.read("default_run"))),
    "default-run-steps": ("docs/getting-started.md", lambda: default_run_steps(_results.read("default_run"))),
    "leash-grid-push": ("docs/leash.md", lambda: leash_grid(_results.read("leash"), True)),
    "leash-grid-nopush": ("docs/leash.md", lambda: leash_grid(_results.read("leash"), False)),
    "leash-push-pairs": ("docs/leash.md", lambda: push_comparison(_results.read("leash"))),
    "leash-lrfollow-pairs": ("docs/leash.md", lambda: lrfollow_comparison(_results.read("leash_lrfollow"),
                                                                         _results.read("leash"))),
    "leash-grid-runs": ("docs/leash.md", lambda: grid_provenance(_results.read("leash"))),
    "sharded": ("docs/scaling.md", lambda: sharded.table(_results.read("sharded"))),
    "estimators": ("docs/objectives.md", lambda: "\n".join(estimators.table(_results.read("estimators")))),
    **default_run_tables.TABLES,
    **frontier_tables.TABLES,
    **tool_tables.TABLES,
    **performance_tables.TABLES,
    **gpu_tables.TABLES,
}


# ------------------------------------------------------------------------------ plots
def plot_grid(path: Path) -> None:
    """KL over the target per step, one panel per setting, each seed a line (push on solid, off dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted((r for r in _results.read("leash") if r["controller"] == "budget"), key=_setting_order)
    names = list(dict.fromkeys(r["setting"] for r in runs))
    if not names:
        return
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for run in (r for r in runs if r["setting"] == name):
            kls = [s.get("kl_exact_per_seq", s["kl_per_seq"]) / run["kl_target"] for s in run["steps"]]
            ax.plot(range(1, len(kls) + 1), kls, linestyle="-" if run["kl_push"] else "--", linewidth=1,
                    label=f"seed {run['seed']}, push {'on' if run['kl_push'] else 'off'}")
        ax.axhspan(1 - BAND, 1 + BAND, color="tab:green", alpha=0.15)
        ax.axhline(GOAL_PEAK, color="tab:red", linestyle=":", linewidth=1)
        ax.axvline(WARM + 0.5, color="grey", linewidth=0.5)
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("exact KL / target", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    max(list(axes.flat)[:len(names)], key=lambda ax: len(ax.lines)).legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_default_run(path: Path) -> None:
    """The default run's overview (``tether plot``'s grid of panels), drawn from seed 0's newest record."""
    import json
    import shutil
    import tempfile

    import yaml

    from tether.train.plots import plot_metrics

    runs = [r for r in _newest(_results.read("default_run")) if r["seed"] == 0]
    if not runs:
        return
    run = runs[0]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(run["full_config"]))
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in run["steps"]))
        (run_dir / "summary.json").write_text(json.dumps(run["summary"]))
        plot_metrics(run_dir)
        shutil.copyfile(run_dir / "plots" / "overview.png", path)


PLOTS: dict[str, Callable[[Path], None]] = {"docs/leash-budget.png": plot_grid,
                                            "docs/default-run-overview.png": plot_default_run, **frontier_tables.PLOTS}


# ------------------------------------------------------------------------------ pages
_BLOCK = re.compile(r"<!-- table:(?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /table -->", re.S)


def rebuild(text: str, page: str) -> tuple[str, list[str]]:
    """``text`` with every table of ``page`` rebuilt, and the names of those that changed."""
    changed: list[str] = []

    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in TABLES or TABLES[name][0] != page:
            raise SystemExit(f"{page}: table {name!r} has no builder in benchmarks/tables.py (known: {sorted(TABLES)})")
        body = TABLES[name][1]() + "\n"
        if body != match["body"]:
            changed.append(name)
        return f"<!-- table:{name} -->\n{body}<!-- /table -->"

    return _BLOCK.sub(fill, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a table is stale")
    args = parser.parse_args(argv)
    stale = []
    for page in sorted({page for page, _ in TABLES.values()}):
        path = ROOT / page
        text, changed = rebuild(path.read_text(), page)
        missing = [n for n, (p, _) in TABLES.items() if p == page and f"<!-- table:{n} -->" not in text]
        stale += [f"{page}: table {n} differs from benchmarks/results" for n in changed]
        stale += [f"{page}: table {n} is missing (add its <!-- table:{n} --> block)" for n in missing]
        if not args.check and changed:
            path.write_text(text)
    if args.check:
        for line in stale:
            print(line)
        return 1 if stale else 0
    for target, draw in PLOTS.items():
        draw(ROOT / target)
    print(f"rebuilt {len(TABLES)} tables and {len(PLOTS)} plots" + (f" ({len(stale)} changed)" if stale else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
