"""Accuracy against KL on the default task: constant beta, the target controller and the budget.

Each point is a full default ``tether train`` run (the embedded model, 16 steps, 150 held-out
problems) with only the leash changed: constant beta in {0.05, 0.1, 0.2, 0.3},
``kl_controller=target`` (target 3) and ``kl_controller=budget`` at targets {1, 2, 3, 4}, at
each ``--seeds`` seed. A run whose ``summary.json`` already exists is read, not re-run, so the
grid can be filled in parts; a run without one resumes from its newest checkpoint. Printed:
held-out accuracy after training and the final exact KL per answer (held-out, and the training
mean of the last 3 steps); the plot (``--plot``) draws accuracy against the held-out exact KL.
``--jobs N`` runs N points at once, each in its own process (on one GPU the runs are host-bound).

    python benchmarks/frontier.py                       # the whole grid, seed 0 (about 2 h on 2 cores)
    python benchmarks/frontier.py --only constant,budget-t2   # a family, a point
    python benchmarks/frontier.py --device cuda --dtype bfloat16 --threads 1 --jobs 18 --seeds 0,1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tether.train.config import TrainConfig
from tether.train.recipe import train

GRID: dict[str, list[dict]] = {
    "constant": [{"kl_controller": "constant", "kl_coef": b} for b in (0.05, 0.1, 0.2, 0.3)],
    "target": [{"kl_controller": "target", "kl_target": 3.0}],
    # The ceiling kl_bound must hold the band's top, 1.25 x the target: target 4 runs with a ceiling of 5.
    "budget": [{"kl_controller": "budget", "kl_target": t, "kl_bound": max(4.0, 1.25 * t)} for t in (1.0, 2.0, 3.0, 4.0)],
}


def name(point: dict, seed: int) -> str:
    knob = f"b{point['kl_coef']:g}" if point["kl_controller"] == "constant" else f"t{point['kl_target']:g}"
    return f"{point['kl_controller']}-{knob}-s{seed}"


def run_point(point: dict, seed: int, args: argparse.Namespace) -> dict:
    out = Path(args.out) / name(point, seed)
    if not (out / "summary.json").is_file():
        cfg = TrainConfig(seed=seed, threads=args.threads, device=args.device, dtype=args.dtype, out=str(out),
                          overwrite=True).override({**point, **dict(kv.split("=", 1) for kv in args.set)})
        # A run cut short (the grid spans sessions) continues from its newest checkpoint, bit-exact.
        resume = any((out / "checkpoints").glob("step_*"))
        train(TrainConfig.from_yaml(out / "config.yaml") if resume else cfg, resume=resume, progress=False)
    return json.loads((out / "summary.json").read_text())


def selected(only: str) -> list[tuple[str, dict]]:
    """``(family, point)`` for each comma-separated family (``budget``) or point (``budget-t2``)."""
    chosen = []
    for word in only.split(","):
        family = word.split("-")[0]
        points = [p for p in GRID.get(family, []) if word == family or name(p, 0)[:-3] == word]
        if not points:
            known = [*GRID, *(name(p, 0)[:-3] for ps in GRID.values() for p in ps)]
            raise SystemExit(f"--only: {word!r} is no family or point; expected some of {known}")
        chosen += [(family, p) for p in points]
    return chosen


def plot(rows: list[tuple[str, dict, dict]], path: Path) -> None:
    """Each run a faint marker; each point's mean over its seeds a solid one with ±1 sd bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    for family, marker in (("constant", "o"), ("target", "s"), ("budget", "^")):
        runs: dict[str, tuple[dict, list[tuple[float, float]]]] = {}
        for f, p, s in rows:
            if f == family:
                runs.setdefault(name(p, 0), (p, []))[1].append((s["eval_kl_per_seq"], 100 * s["accuracy_after"]))
        if not runs:
            continue
        means = sorted((*np.mean(xy, 0), *np.std(xy, 0, ddof=min(1, len(xy) - 1)), p, np.array(xy))
                       for p, xy in runs.values())
        line = ax.errorbar([m[0] for m in means], [m[1] for m in means], xerr=[m[2] for m in means],
                           yerr=[m[3] for m in means], marker=marker, capsize=2, elinewidth=0.8,
                           linestyle="-" if family != "target" else "", label=family)
        for x, y, _, _, p, xy in means:
            ax.scatter(xy[:, 0], xy[:, 1], marker=marker, s=12, alpha=0.3, color=line.lines[0].get_color())
            ax.annotate(f"β {p['kl_coef']:g}" if family == "constant" else f"{p['kl_target']:g}", (x, y),
                        fontsize=7, textcoords="offset points", xytext=(4, -9))
    ax.set_xlabel("held-out exact KL to the reference per answer (nats)")
    ax.set_ylabel("held-out accuracy after 16 steps (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(GRID),
                        help="comma-separated families (constant,target,budget) or points (budget-t2)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides on every point")
    parser.add_argument("--jobs", type=int, default=1, help="points run at once, each in its own process")
    parser.add_argument("--out", default="runs/frontier")
    parser.add_argument("--json", default="", help="every point's summary and per-step metrics into one file")
    parser.add_argument("--plot", default="", help="PNG path of the accuracy-KL plot (every run found in --out)")
    args = parser.parse_args(argv)
    grid = [(family, point, seed) for family, point in selected(args.only) for seed in map(int, args.seeds.split(","))]
    # Spawned, not forked: a forked child cannot use CUDA. A point that fails is named and left out.
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_point, p, s, args) for _, p, s in grid]
        summaries = []
        for (_, point, seed), future in zip(grid, futures):
            try:
                summaries.append(future.result())
            except Exception as exc:  # noqa: BLE001 - one broken run must not lose the others' points
                print(f"{name(point, seed)}: failed: {type(exc).__name__}: {exc}", flush=True)
                summaries.append(None)
    rows = []
    print("| leash | seed | accuracy before | accuracy after | held-out exact KL | training exact KL (last 3) | over bound |")
    print("|---|---|---|---|---|---|---|")
    for (family, point, seed), s in zip(grid, summaries):
        if s is None:
            continue
        rows.append((family, point, s))
        print(f"| {name(point, seed)[:-3]} | {seed} | {100 * s['accuracy_before']:.1f} % | "
              f"{100 * s['accuracy_after']:.1f} % | {s['eval_kl_per_seq']:.2f} | "
              f"{s['final_train_kl_exact_per_seq']:.2f} | {s['steps_over_kl_bound']} |", flush=True)
    if args.json:
        steps = {name(p, seed): [json.loads(line) for line in (Path(args.out) / name(p, seed) / "metrics.jsonl").open()]
                 for (_, p, seed), s in zip(grid, summaries) if s is not None}
        Path(args.json).write_text(json.dumps({"summaries": {name(p, seed): s for (_, p, seed), s in zip(grid, summaries)},
                                               "steps": steps}, indent=1))
    if args.plot:
        plot(rows, Path(args.plot))


if __name__ == "__main__":
    main()
