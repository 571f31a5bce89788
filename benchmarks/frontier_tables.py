"""The frontier page's tables and plot, from ``benchmarks/results/frontier.jsonl`` (``tables.py`` runs them).

Each point: its mean over seeds and 95 % t interval of held-out accuracy and held-out KL, the
gain over the untrained model, the forgetting axis, and its residual against a constant-beta
curve (``CURVE_OF``: full fine-tuning's for the fully fine-tuned moving reference, LoRA's for
every other variant, drawn again from the 48-step ``long-`` points for the long runs). A curve: its
constant-beta points' means (beta = 0 included), ordered by mean KL and
joined by straight lines, the first extended below them and flat beyond the last; a run's residual is its accuracy
less the curve at its own KL, and a point's residual is the mean and t interval of its runs'.
That interval is over the point's seeds only; a second one adds the curve's own noise. Records of ``--quick``
runs are never shown; ``--reduced`` ones get their own, labelled table. The power table pools
the variants' residual spread over seeds and says how many seeds a 2-point residual needs.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any, Callable

import _results
from _stats import interval, t95, welch

PLOT = "docs/frontier.png"


def _family(point: str) -> str:
    """``budget-push-t2`` -> ``budget-push``, ``constant-0.1`` -> ``constant``, ``base`` -> ``base``."""
    return re.sub(r"-t?[\d.]+$", "", point)


# Family -> the constant-beta family whose curve its residual is read against: fully fine-tuned
# variants against the fully fine-tuned constant beta; every other family against LoRA's.
CURVES = ("constant", "full-constant", "long-constant")
CURVE_OF: dict[str, str] = {"full-budget-moving": "full-constant", "long-budget": "long-constant",
                            "long-budget-avg": "long-constant", "long-budget-moving": "long-constant"}


def curve_family(point: str) -> str | None:
    """The curve a point's residual is read against; None for a point on a curve itself."""
    family = _family(point)
    return None if family in CURVES else CURVE_OF.get(family, "constant")


def curve_knots(records: list[dict[str, Any]], family: str) -> list[tuple[float, float, float, int]]:
    """``(mean KL, mean accuracy, variance of that mean, seeds)`` of each point of ``family``, by KL."""
    points: dict[str, list[dict]] = {}
    for r in records:
        if _family(r["point"]) == family:
            points.setdefault(r["point"], []).append(r)
    out = []
    for rs in points.values():
        accuracy = [r["heldout_accuracy"] for r in rs]
        spread = statistics.variance(accuracy) / len(rs) if len(rs) > 1 else math.nan
        out.append((statistics.fmean(r["heldout_kl_sampled_per_seq"] for r in rs), statistics.fmean(accuracy), spread, len(rs)))
    return sorted(out)


def curve(records: list[dict[str, Any]], family: str = "constant") -> list[tuple[float, float]]:
    """``(mean KL, mean accuracy)`` of each point of the constant-beta ``family``, by KL: the curve's knots."""
    return _xy(curve_knots(records, family))


def _xy(stats: list[tuple[float, float, float, int]]) -> list[tuple[float, float]]:
    return [(kl, accuracy) for kl, accuracy, _, _ in stats]


def _segment(knots: list[tuple[float, float]], kl: float) -> tuple[int, float, float]:
    """``(i, w0, w1)``: the curve at ``kl`` is ``w0`` x knot ``i - 1``'s accuracy + ``w1`` x knot ``i``'s.
    Below the first knot the first segment is extended; beyond the last (no constant beta, not even
    0, ended further out) the curve stays at the last knot's accuracy, so a run there is compared
    with that knot itself, not with a line whose weights would multiply both knots' noise."""
    if len(knots) < 2:
        raise ValueError(f"knots: expected at least two constant-beta points to draw a curve, got {len(knots)}.")
    i = 1
    while i < len(knots) - 1 and kl > knots[i][0]:
        i += 1
    (x0, _), (x1, _) = knots[i - 1], knots[i]
    w1 = min(0.0 if x1 == x0 else (kl - x0) / (x1 - x0), 1.0)
    return i, 1.0 - w1, w1


def on_curve(knots: list[tuple[float, float]], kl: float) -> float:
    """The curve's accuracy at ``kl``: linear between the knots around it, the first segment extended
    below them, flat at the last knot beyond them (``_segment``)."""
    i, w0, w1 = _segment(knots, kl)
    return w0 * knots[i - 1][1] + w1 * knots[i][1]


def residuals(runs: list[dict[str, Any]], knots: list[tuple[float, float]]) -> list[float]:
    """Each run's accuracy less the curve's at the run's own held-out KL."""
    return [r["heldout_accuracy"] - on_curve(knots, r["heldout_kl_sampled_per_seq"]) for r in runs]


def residual_with_curve(runs: list[dict[str, Any]], stats: list[tuple[float, float, float, int]]) -> tuple[float, float, float]:
    """A point's mean residual and its 95 % interval with the curve's own noise in: the variance of
    the runs' mean residual plus each knot's variance of its mean accuracy times its weight in the
    curve at the runs' KLs squared, on Welch-Satterthwaite's degrees of freedom (rounded down).
    ``stats``: the curve's ``curve_knots``. The knots' KLs are taken as known. NaN bounds when a part has one seed."""
    xy = _xy(stats)
    values, weights = residuals(runs, xy), [0.0] * len(xy)
    for r in runs:
        i, w0, w1 = _segment(xy, r["heldout_kl_sampled_per_seq"])
        weights[i - 1], weights[i] = weights[i - 1] + w0 / len(runs), weights[i] + w1 / len(runs)
    parts = [(statistics.variance(values) / len(values) if len(values) > 1 else math.nan, len(values) - 1)]
    return welch(statistics.fmean(values), parts + [(w * w * spread, n - 1) for w, (_, _, spread, n) in zip(weights, stats) if w])


def _cell(values: list[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    values = [scale * v for v in values if v is not None]
    if not values:
        return "–"
    return _span(*interval(values), fmt=fmt)


def _span(mean: float, low: float, high: float, fmt: str) -> str:
    return fmt.format(mean) if math.isnan(low) else f"{fmt.format(mean)} ({fmt.format(low)} to {fmt.format(high)})"


def _order(point: str) -> tuple:
    number = re.search(r"([\d.]+)$", point)
    return ({"base": 0, "constant": 1, "budget": 2, "budget-push": 3, "best-of-n": 5}.get(_family(point), 4),
            _family(point), float(number.group(1)) if number else 0.0)


def points_table(records: list[dict[str, Any]], mode: str) -> str:
    """One row per point of ``mode``'s records: means and 95 % intervals over the seeds."""
    records = [r for r in records if r.get("mode") == mode]
    if not records:
        return f"No {mode} frontier runs recorded yet (`python benchmarks/frontier.py{'' if mode == 'full' else ' --' + mode}`)."
    stats = {family: curve_knots(records, family) for family in CURVES}
    curves = {family: _xy(k) for family, k in stats.items()}
    base = {r["seed"]: r["heldout_accuracy"] for r in records if r["point"] == "base"}
    lines = ["| point | seeds | held-out accuracy, % | gain over the untrained model, points | held-out KL, sampled "
             "(nats / answer) | residual vs constant β (its curve), points | the same, the curve's noise in | "
             "chat-prompt KL (nats / answer) | instructions followed, % |",
             "|---|---|---|---|---|---|---|---|---|"]
    by_point: dict[str, list[dict]] = {}
    for r in records:
        by_point.setdefault(r["point"], []).append(r)
    for point in sorted(by_point, key=_order):
        rs = sorted(by_point[point], key=lambda r: r["seed"])
        gains = [r["heldout_accuracy"] - base[r["seed"]] for r in rs if r["seed"] in base]
        against = curve_family(point)
        knots = curves[against] if against else []
        residual = "–" if len(knots) < 2 else _cell(residuals(rs, knots), 100, "{:+.1f}")
        residual += f" ({against})" if residual != "–" and against != "constant" else ""
        noisy = "–" if len(knots) < 2 else _span(*(100 * v for v in residual_with_curve(rs, stats[against])), fmt="{:+.1f}")
        mean_kl = sum(r["heldout_kl_sampled_per_seq"] for r in rs) / len(rs)
        outside = knots and not knots[0][0] <= mean_kl <= knots[-1][0]
        paired = "" if len(gains) == len(rs) else f" ({len(gains)} of {len(rs)} seeds: the others have no base run)"
        lines.append(f"| {point} | {len(rs)} | {_cell([r['heldout_accuracy'] for r in rs], 100)} | {_cell(gains, 100, '{:+.1f}')}{paired} "
                     f"| {_cell([r['heldout_kl_sampled_per_seq'] for r in rs], fmt='{:.2f}')} | {residual}"
                     f"{' (extrapolated)' if outside and residual != '–' else ''} | {noisy} "
                     f"| {_cell([r.get('forgetting_kl_sampled_per_seq') for r in rs], fmt='{:.2f}')} "
                     f"| {_cell([r.get('capability_rate') for r in rs], 100)} |")
    return "\n".join(lines) + "\n\n" + provenance(records) + (f"\n\n![The frontier, {mode} runs](frontier.png)"
                                                              if mode == _plotted_mode(_results.read("frontier")) else "")


# The seed counts whose interval widths the power table shows (3: the reduced mode's, 8: the full grid's).
POWER_SEEDS = (3, 8, 16, 32)
POWER_GOAL = 2.0  # points: the half-width under which a 2-point residual's interval clears 0


def residual_spread(records: list[dict[str, Any]]) -> tuple[float, int, int]:
    """``(sd, df, runs)``: the spread over seeds of the trained variants' residuals, pooled over
    every variant point with two or more seeds (each point's own mean taken out), in accuracy."""
    curves = {family: curve(records, family) for family in CURVES}
    squares, df, runs = 0.0, 0, 0
    for point in sorted({r["point"] for r in records}):
        against = curve_family(point)
        rs = [r for r in records if r["point"] == point]
        if against is None or _family(point) in ("base", "best-of-n") or len(rs) < 2 or len(curves[against]) < 2:
            continue
        values = residuals(rs, curves[against])
        mean = sum(values) / len(values)
        squares += sum((v - mean) ** 2 for v in values)
        df, runs = df + len(values) - 1, runs + len(values)
    return (math.sqrt(squares / df) if df else math.nan), df, runs


def seeds_for(sd: float, half_width: float) -> int:
    """The fewest seeds whose 95 % t interval of a mean is at most ``half_width`` at spread ``sd``
    (beyond 31 seeds the t quantile stays at 30 degrees of freedom's 2.042: a seed or two too many)."""
    n = 2
    while t95(n) * sd / math.sqrt(n) > half_width:
        n += 1
    return n


def power_table(records: list[dict[str, Any]]) -> str:
    """Per mode: how wide a variant's residual interval is at a number of seeds, from the spread
    its runs showed, and the seeds a half-width of ``POWER_GOAL`` points needs."""
    lines = ["| mode | variant runs (df) | residual spread over seeds, sd (points) | half-width of a point's 95 % interval at "
             + " / ".join(map(str, POWER_SEEDS)) + f" seeds (points) | seeds for a half-width of {POWER_GOAL:g} points |",
             "|---|---|---|---|---|"]
    for mode in ("full", "reduced"):
        sd, df, runs = residual_spread([r for r in records if r.get("mode") == mode])
        if df:
            widths = " / ".join(f"{100 * t95(n) * sd / math.sqrt(n):.1f}" for n in POWER_SEEDS)
            lines.append(f"| {mode} | {runs} ({df}) | {100 * sd:.1f} | {widths} | {seeds_for(100 * sd, POWER_GOAL)} |")
    if len(lines) == 2:
        return "No variant has two seeds yet: the spread over seeds needs them (`python benchmarks/frontier.py`)."
    return "\n".join(lines)


def provenance(records: list[dict[str, Any]]) -> str:
    """Where, when and at what size the records ran."""
    stamps = sorted({(r["device"], r["dtype"], r["commit"], r["date"]) for r in records})
    sizes = sorted({(r["model"], r["eval_size"], r.get("chat_prompts")) for r in records if r.get("chat_prompts")})
    where = "; ".join(f"{d} ({t}), commit {c}, {when}" for d, t, c, when in stamps)
    size = "; ".join(f"model {m}, {e} held-out problems, {c} chat prompts" for m, e, c in sizes)
    return f"{len(records)} records: {size}. Ran on {where}."


def _plotted_mode(records: list[dict[str, Any]]) -> str | None:
    modes = {r.get("mode") for r in records}
    return "full" if "full" in modes else "reduced" if "reduced" in modes else None


def plot(path: Path) -> None:
    """Accuracy against held-out KL (each point's mean with 95 % bars, the constant-beta curve,
    best-of-n as a line) and accuracy gain against the chat-prompt KL; nothing without records."""
    records = _results.read("frontier")
    mode = _plotted_mode(records)
    if mode is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in records if r.get("mode") == mode]
    base = {r["seed"]: r["heldout_accuracy"] for r in records if r["point"] == "base"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    families: dict[str, dict[str, list[dict]]] = {}
    for r in records:
        families.setdefault(_family(r["point"]), {}).setdefault(r["point"], []).append(r)
    for family, points in sorted(families.items()):
        rows = sorted((_summary(rs, "heldout_kl_sampled_per_seq"), _summary(rs, "heldout_accuracy", 100),
                       _gains(rs, base), _summary(rs, "forgetting_kl_sampled_per_seq")) for rs in points.values())
        style = "-" if family in (*CURVES, "best-of-n") else ":"
        _bars(left, [x for x, _, _, _ in rows], [y for _, y, _, _ in rows], family, style)
        _bars(right, [f for _, _, _, f in rows], [g for _, _, g, _ in rows], family, "")
    # Intervals of two seeds (t = 12.7) run past what can be: the axes keep to accuracy and KL's ranges.
    left.set_ylim(0, 100)
    left.set_xlim(left=0)
    right.set_xlim(left=0)
    right.set_ylim(-25, 85)  # a gain lies in [-base, 100 - base]; the untrained model reads 18 %
    left.set_xlabel("held-out KL of sampled answers to the reference (nats / answer)")
    left.set_ylabel("held-out accuracy (%)")
    right.set_xlabel("chat-prompt KL of sampled answers (nats / answer): forgetting")
    right.set_ylabel("accuracy gain over the untrained model (points)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    fig.suptitle(f"{mode} runs: means with 95 % intervals over seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _summary(rs: list[dict], key: str, scale: float = 1.0) -> tuple[float, float]:
    values = [scale * r[key] for r in rs if r.get(key) is not None]
    if not values:
        return math.nan, 0.0
    mean, low, _ = interval(values)
    return mean, 0.0 if math.isnan(low) else mean - low


def _gains(rs: list[dict], base: dict[int, float]) -> tuple[float, float]:
    gains = [100 * (r["heldout_accuracy"] - base[r["seed"]]) for r in rs if r["seed"] in base]
    if not gains:
        return math.nan, 0.0
    mean, low, _ = interval(gains)
    return mean, 0.0 if math.isnan(low) else mean - low


def _bars(ax, xs: list[tuple[float, float]], ys: list[tuple[float, float]], label: str, style: str) -> None:
    ax.errorbar([x for x, _ in xs], [y for y, _ in ys], xerr=[e for _, e in xs], yerr=[e for _, e in ys],
                marker="o", markersize=4, capsize=2, elinewidth=0.8, linestyle=style or "none", label=label)


TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "frontier-points": ("docs/frontier.md", lambda: points_table(_results.read("frontier"), "full")),
    "frontier-reduced": ("docs/frontier.md", lambda: points_table(_results.read("frontier"), "reduced")),
    "frontier-power": ("docs/frontier.md", lambda: power_table(_results.read("frontier"))),
}
PLOTS: dict[str, Callable[[Path], None]] = {PLOT: plot}
