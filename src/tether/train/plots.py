"""``tether plot``: one PNG per curve of a run's ``metrics.jsonl``, and an overview grid.

Each curve has an integer step axis; the held-out accuracy is marked before training, at each
periodic evaluation and after (from ``summary.json``); the KL panel draws the bound, the target
band and the exact and kept KLs beside the measured one. A curve constant by the run's settings
is left out (``constant_panels``); a run's optional curves (tools, the KL budget, each reward
function) are drawn when its records carry them (``plotted_for``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tether.train.config import TrainConfig
from tether.train.metrics import MetricsLog

# (metric key, plot title, y label) for every curve ``tether plot`` draws.
PLOTTED: tuple[tuple[str, str, str], ...] = (
    ("reward_mean", "Reward (mean over samples)", "reward"),
    ("accuracy", "Accuracy: training (sampled), held-out (greedy)", "fraction correct"),
    ("kl_per_seq", "KL to reference (per sequence)", "nats"),
    ("kl_per_token", "KL to reference (per token)", "nats"),
    ("kl_coef", "KL coefficient", "beta"),
    ("clip_fraction", "Clip fraction", "fraction"),
    ("ess", "Effective sample size / N", "ESS / N"),
    ("entropy", "Policy entropy (per token)", "nats"),
    ("response_length", "Response length", "tokens"),
    ("grad_norm", "Gradient norm (before clipping)", "L2 norm"),
    ("lr", "Learning rate", "lr"),
)
# Drawn only for runs whose records carry them (tasks with tools, the KL budget).
OPTIONAL_PLOTTED: tuple[tuple[str, str, str], ...] = (
    ("tool_call_rate", "Episodes calling a tool", "fraction"),
    ("tool_error_rate", "Tool calls that failed", "fraction"),
    ("turns_per_episode", "Assistant turns per episode", "turns"),
    ("kl_move_scale", "KL leash: scale kept (1 = update untouched)", "scale s"),
    ("kl_move_forwards", "KL leash: policy forwards spent", "forwards"),
    ("kl_behaviour_per_token", "Sampler-learner KL (per token)", "nats"),
)
# The KL panel's extra curves: the exact KL, the updated weights' KL and the kept weights' KL.
_KL_EXTRA = ("kl_exact_per_seq", "kl_move_before_per_seq", "kl_kept_per_seq")


def plotted_for(records: list[dict[str, Any]]) -> tuple[tuple[str, str, str], ...]:
    """``PLOTTED`` plus the optional curves some record holds, and one curve per reward function
    (``reward/<name>``, logged when ``reward_funcs`` or a reward model scores the run)."""
    functions = dict.fromkeys(k for r in records for k in r if k.startswith("reward/"))
    return (PLOTTED + tuple(c for c in OPTIONAL_PLOTTED if any(c[0] in r for r in records))
            + tuple((k, f"Reward function {k.removeprefix('reward/')!r} (mean)", "reward") for k in functions))


def curve_data(records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """``{metric: (steps, values)}`` for every plotted curve (NaN where a step lacks it)."""
    steps = [r["step"] for r in records]
    return {key: (steps, [r.get(key, float("nan")) for r in records]) for key, _, _ in plotted_for(records)}


_FRACTIONS = {"accuracy", "clip_fraction", "ess", "tool_call_rate", "tool_error_rate"}


def _run_config(run_dir: Path) -> dict[str, Any]:
    """The run's config.yaml as a mapping ({} if absent): the KL plot draws its bound and target."""
    import yaml

    path = run_dir / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


# Fraction of the target that counts as holding it for a controller of beta (+-25 %), drawn on the
# KL plot of the target and adaptive controllers and read by the leash benchmarks.
TARGET_BAND = 0.25


def _draw_kl_guides(ax, config: dict[str, Any], curves: dict[str, tuple[list[int], list[float]]]) -> None:
    """Exact KL beside the sampled one, the bound, and the target band of a controlled run."""
    for key, marker in zip(_KL_EXTRA, "s^v"):
        steps, values = curves.get(key, ([], []))
        if any(v == v for v in values):  # not all NaN: the run logged it
            ax.plot(steps, values, marker=marker, markersize=3, label=key)
    bound = config.get("kl_bound")
    if isinstance(bound, (int, float)):
        ax.axhline(bound, color="tab:red", linestyle="--", linewidth=1, label="kl_bound")
    target = config.get("kl_target")
    if not isinstance(target, (int, float)):
        pass
    elif config.get("kl_controller") == "budget":  # the band the budget acts on, and the most a move keeps
        band = config.get("kl_band", TrainConfig.kl_band)
        low = target * (1 - band) if config.get("kl_push", TrainConfig.kl_push) else 0.0
        ax.axhspan(low, target * (1 + band / 2), color="tab:green", alpha=0.15, label="budget: weights not moved")
        ax.axhline(target * (1 + band), color="tab:green", linestyle=":", linewidth=1, label="budget: most kept")
    elif config.get("kl_controller") in ("adaptive", "target"):
        ax.axhspan(target * (1 - TARGET_BAND), target * (1 + TARGET_BAND), color="tab:green", alpha=0.15,
                   label=f"kl_target +-{TARGET_BAND:.0%}")
    ax.legend(loc="upper left", fontsize=8)


def constant_panels(config: dict[str, Any]) -> set[str]:
    """Keys of ``PLOTTED`` whose curve cannot vary under the run's config (a config.yaml mapping).

    With one update per rollout every ratio is 1 up to rounding (the batch is trained on by
    the weights that sampled it), so the clip fraction is 0 and the ESS 1; a constant KL
    controller never moves beta; a constant schedule without warm-up never moves the rate.
    """
    default = TrainConfig()  # a key the mapping lacks has its default value

    def setting(name: str) -> Any:
        return config.get(name, getattr(default, name))

    constant = set()
    if setting("updates_per_rollout") == 1:
        constant |= {"clip_fraction", "ess"}
    if setting("kl_controller") == "constant":
        constant.add("kl_coef")
    if setting("lr_schedule") == "constant" and not setting("warmup_steps"):
        constant.add("lr")
    return constant


def plotted_panels(config: dict[str, Any], records: list[dict[str, Any]] = ()) -> list[tuple[str, str, str]]:
    """The curves drawn for a run with this config: ``PLOTTED`` less the constant ones, plus
    the optional curves (tool use) that some of its ``records`` carry."""
    constant = constant_panels(config)
    if records:  # a curve no step logged (accuracy in a dataset run) has nothing to draw
        constant |= {key for key, _, _ in PLOTTED if not any(key in r for r in records)}
    return [entry for entry in plotted_for(list(records)) if entry[0] not in constant]


def _draw_held_out(ax, run_dir: Path, records: list[dict[str, Any]]) -> None:
    """Held-out accuracy markers: before (step 0), periodic evaluations, after (last step)."""
    evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    if evals:
        ax.plot(*zip(*evals), marker="s", linestyle="--", color="tab:purple", label="held-out (eval_every)")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if summary.get("accuracy_before") is not None:
        ax.plot([0], [summary["accuracy_before"]], marker="*", markersize=11, linestyle="", color="tab:green",
                label=f"held-out before {summary['accuracy_before']:.2f}")
    if summary.get("accuracy_after") is not None:
        ax.plot([records[-1]["step"]], [summary["accuracy_after"]], marker="*", markersize=11, linestyle="",
                color="tab:red", label=f"held-out after {summary['accuracy_after']:.2f}")
    if evals or summary:
        ax.legend(loc="best", fontsize=7)


def _style(ax, key: str, title: str, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    # Offsets turn an ESS of 1 - 1e-7 into "1e-6 + 1" tick labels; fractions get [0, 1].
    ax.ticklabel_format(axis="y", useOffset=False)
    if key in _FRACTIONS:
        ax.set_ylim(-0.02, 1.02)


def plot_metrics(run_dir: Path) -> list[Path]:
    """Write one PNG per curve of ``plotted_panels`` plus an overview grid; return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not run_dir.is_dir():
        what = "is a file" if run_dir.exists() else "does not exist"
        raise ValueError(f"{run_dir}: {what}; expected a run directory (the --out of tether train). Check the path.")
    if not (run_dir / "metrics.jsonl").is_file():
        raise ValueError(f"{run_dir}: holds no metrics.jsonl, so it is not a tether run directory; give the --out "
                         "of a tether train run.")
    records = MetricsLog(run_dir / "metrics.jsonl").read()
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl: no metrics to plot; run some steps first.")
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    curves = curve_data(records)
    curves.update({key: ([r["step"] for r in records], [r.get(key, float("nan")) for r in records]) for key in _KL_EXTRA})
    config = _run_config(run_dir)
    panels = plotted_panels(config, records)
    written: list[Path] = []
    cols = 3
    rows = math.ceil(len(panels) / cols)
    grid, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows))
    for ax_grid, (key, title, ylabel) in zip(axes.flat, panels):
        steps, values = curves[key]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for target in (ax, ax_grid):
            target.plot(steps, values, marker="o", markersize=3, label=key)
            _style(target, key, title, ylabel)
            if key == "kl_per_seq":
                _draw_kl_guides(target, config, curves)
            if key == "accuracy":
                _draw_held_out(target, run_dir, records)
        fig.tight_layout()
        path = out_dir / f"{key.replace('/', '_')}.png"  # reward/<name>: no subfolder
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    grid.tight_layout()
    overview = out_dir / "overview.png"
    grid.savefig(overview, dpi=80)
    plt.close(grid)
    written.append(overview)
    return written
