"""Accuracy against KL on the default task: constant beta, the target controller and the budget.

Each point is a full default ``tether train`` run (the embedded model, 16 steps, 150 held-out
problems) with only the leash changed: constant beta in {0.05, 0.1, 0.2, 0.3},
``kl_controller=target`` (target 3) and ``kl_controller=budget`` at targets {1, 2, 3, 4}, at
each ``--seeds`` seed. A run whose ``summary.json`` already exists is read, not re-run, so the
grid can be filled in parts; a run without one resumes from its newest checkpoint. Printed: held-out accuracy after training and the final exact
KL per answer (held-out, and the training mean of the last 3 steps); the plot
(``--plot``) draws accuracy against the held-out exact KL, one marker per leash.

    python benchmarks/frontier.py                       # the whole grid, seed 0 (about 55 min)
    python benchmarks/frontier.py --only constant       # one family
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tether.train.config import TrainConfig
from tether.train.recipe import train

GRID: dict[str, list[dict]] = {
    "constant": [{"kl_controller": "constant", "kl_coef": b} for b in (0.05, 0.1, 0.2, 0.3)],
    "target": [{"kl_controller": "target", "kl_target": 3.0}],
    "budget": [{"kl_controller": "budget", "kl_target": t} for t in (1.0, 2.0, 3.0, 4.0)],
}


def name(point: dict, seed: int) -> str:
    knob = f"b{point['kl_coef']:g}" if point["kl_controller"] == "constant" else f"t{point['kl_target']:g}"
    return f"{point['kl_controller']}-{knob}-s{seed}"


def run_point(point: dict, seed: int, args: argparse.Namespace) -> dict:
    out = Path(args.out) / name(point, seed)
    if not (out / "summary.json").is_file():
        cfg = TrainConfig(seed=seed, threads=args.threads, out=str(out), overwrite=True).override(point)
        # A run cut short (the grid spans sessions) continues from its newest checkpoint, bit-exact.
        resume = any((out / "checkpoints").glob("step_*"))
        train(TrainConfig.from_yaml(out / "config.yaml") if resume else cfg, resume=resume, progress=False)
    return json.loads((out / "summary.json").read_text())


def plot(rows: list[tuple[str, dict, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    for family, marker in (("constant", "o"), ("target", "s"), ("budget", "^")):
        pts = sorted((s["eval_kl_per_seq"], 100 * s["accuracy_after"], p) for f, p, s in rows if f == family)
        if not pts:
            continue
        ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], marker=marker, linestyle="-" if family != "target" else "",
                label=family)
        for x, y, p in pts:
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
    parser.add_argument("--only", default=",".join(GRID), help="comma-separated families: constant,target,budget")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/frontier")
    parser.add_argument("--plot", default="", help="PNG path of the accuracy-KL plot (every run found in --out)")
    args = parser.parse_args(argv)
    rows = []
    print("| leash | seed | accuracy before | accuracy after | held-out exact KL | training exact KL (last 3) | over bound |")
    print("|---|---|---|---|---|---|---|")
    for family in args.only.split(","):
        for point in GRID[family]:
            for seed in map(int, args.seeds.split(",")):
                s = run_point(point, seed, args)
                rows.append((family, point, s))
                print(f"| {name(point, seed)[:-3]} | {seed} | {100 * s['accuracy_before']:.1f} % | "
                      f"{100 * s['accuracy_after']:.1f} % | {s['eval_kl_per_seq']:.2f} | "
                      f"{s['final_train_kl_exact_per_seq']:.2f} | {s['steps_over_kl_bound']} |", flush=True)
    if args.plot:
        plot(rows, Path(args.plot))


if __name__ == "__main__":
    main()
