"""Does the leash hold? Constant beta, Ziegler's adaptive controller, the target controller, the budget.

Each run is ``tether train`` on the embedded SmolLM2-135M-Instruct and the arithmetic task at
a reduced step (``--prompts`` x ``--group`` answers of up to ``--max-new-tokens``, ``--steps``
steps, no held-out evaluation). Seven settings: learning rate x3.3 by starting beta x30 in the
loss mode, the higher rate also in the reward mode, and beta started 30x below the too-weak
0.02. In each, every controller aims at one ``--kl-target``, at each of ``--seeds``.

Each run's per-step record goes to ``benchmarks/results/leash.jsonl`` (``tables.py`` rebuilds the
leash page's tables and plot from it); with ``--lr-follow`` the budget's runs take ``kl_adaptive_lr``
and go to ``leash_lrfollow.jsonl``, paired there with the plain budget's. Scored per run: the share
of steps 5-16 whose exact KL per answer (of the step's own batch, read by the weights that sampled it) lies within +-25 % of the
target, the largest such KL over the target, the steps whose kept weights read over ``kl_bound``
(3) and the rejected updates. The goal: >= 80 % in band and no step above 1.5x the target in
every run. A run whose directory holds a ``summary.json`` is read, not re-run.

    python benchmarks/leash.py --controllers budget --seeds 0,1,2   # the budget's grid
    python benchmarks/leash.py --settings 5,6 --push off            # two settings without the push
    python benchmarks/leash.py --quick                              # 1 setting, 3 steps, tiny batches
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import _results
from tether.train.config import TrainConfig
from tether.train.plots import TARGET_BAND
from tether.train.recipe import train

# What each run's record keeps of a step's metrics.
STEP_KEYS = ("step", "kl_per_seq", "kl_exact_per_seq", "kl_move_before_per_seq", "kl_kept_per_seq", "kl_move_scale",
             "kl_move_forwards", "step_rejected", "kl_over_bound", "kl_coef", "reward_mean", "step_time",
             "kl_move_seconds", "lr", "lr_multiplier")

CONTROLLERS = ("constant", "adaptive", "target", "budget")


@dataclass(frozen=True)
class Setting:
    learning_rate: float
    kl_coef: float
    kl_mode: str

    @property
    def name(self) -> str:
        return f"lr {self.learning_rate:g}, beta0 {self.kl_coef:g}, {self.kl_mode}"


def settings(quick: bool) -> list[Setting]:
    if quick:
        return [Setting(3e-4, 0.6, "loss")]
    # At lr 1e-4 this reduced step (24 answers of 16 tokens) moves the KL so slowly that it
    # reaches 1 nat only at step 16 even with beta near 0: no controller can be in the band
    # after the warm-up quarter, so the grid starts at 3e-4.
    grid = [Setting(lr, beta, "loss") for lr in (3e-4, 1e-3) for beta in (0.02, 0.6)]
    # 0.02 is already too weak at lr 1e-3 (constant beta ends at 7.9 nats); this start is 30x below it.
    return grid + [Setting(1e-3, beta, "reward") for beta in (0.02, 0.6)] + [Setting(1e-3, 0.02 / 30, "loss")]


def run_one(setting: Setting, controller: str, seed: int, push: bool, args: argparse.Namespace) -> list[dict]:
    follow = args.lr_follow and controller == "budget"
    tag = f"{setting.kl_mode}-lr{setting.learning_rate:g}-b{setting.kl_coef:g}-{controller}-s{seed}" + (
        "" if push else "-nopush") + ("-lrfollow" if follow else "")
    out = Path(args.out) / tag
    cfg = TrainConfig(
        steps=args.steps, prompts_per_step=args.prompts, group_size=args.group, seed=seed,
        max_new_tokens=args.max_new_tokens, micro_batch_size=args.prompts * args.group,
        learning_rate=setting.learning_rate, kl_coef=setting.kl_coef, kl_mode=setting.kl_mode,
        kl_estimator="k3" if setting.kl_mode == "loss" else "k1", kl_controller=controller, kl_push=push,
        kl_target=args.kl_target, kl_signal="exact", kl_bound=3.0, eval_size=0, checkpoint_every=0, out=str(out),
        threads=args.threads, overwrite=True, kl_adaptive_lr=follow,
    )
    stamp = _results.stamp()  # the code the run ran, not the code when it ended
    if not (out / "summary.json").is_file():  # a finished run is read, not re-run
        train(cfg, progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if not args.quick:
        _results.write("leash_lrfollow" if follow else "leash", {
            "setting": setting.name, "learning_rate": setting.learning_rate, "kl_coef": setting.kl_coef,
            "kl_mode": setting.kl_mode, "controller": controller, "seed": seed, "kl_push": push,
            "kl_target": args.kl_target, "kl_bound": cfg.kl_bound, "kl_adaptive_lr": follow,
            "prompts": args.prompts, "group": args.group,
            "max_new_tokens": args.max_new_tokens, "threads": args.threads, **stamp,
            "steps": [{k: r[k] for k in STEP_KEYS if k in r} for r in records],
        }, key=("setting", "controller", "seed", "kl_push", "kl_target"))
    return records


def row(records: list[dict], target: float) -> dict:
    kls = [r.get("kl_exact_per_seq", r["kl_per_seq"]) for r in records]
    warm = len(records) // 4
    after = kls[warm:] or kls
    tail = [r["reward_mean"] for r in records[len(records) - max(len(records) // 4, 1):]]
    return {
        "in_band": sum(abs(kl / target - 1) <= TARGET_BAND for kl in after) / len(after),
        "final_kl": sum(kls[-3:]) / len(kls[-3:]),
        "reward_gain": sum(tail) / len(tail) - records[0]["reward_mean"],
        "over_bound": sum(bool(r["kl_over_bound"]) for r in records),
        "rejected": sum(bool(r.get("step_rejected")) for r in records),
        "peak": max(after) / target,
        "kls": kls,
    }


def plot(results: dict, controllers: list[str], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(name for name, _ in results))
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        for controller in controllers:
            kls = results[name, controller]["kls"]
            ax.plot(range(1, len(kls) + 1), kls, marker="o", markersize=3, label=controller)
        ax.axhspan(target * (1 - TARGET_BAND), target * (1 + TARGET_BAND), color="tab:green", alpha=0.15)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("exact KL / answer (nats)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 setting, 3 steps, 2x2 answers of 8 tokens")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--kl-target", type=float, default=1.0, help="nats per answer, the same for every run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/leash")
    parser.add_argument("--settings", default="", help="comma-separated 1-based indices of the settings to run "
                        "(default: all; the others are skipped, so parts of the grid can run in parallel)")
    parser.add_argument("--controllers", default=",".join(CONTROLLERS),
                        help="comma-separated subset of constant,adaptive,target,budget (default: all four)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, each a run of every setting")
    parser.add_argument("--push", choices=("on", "off", "both"), default="on", help="the budget's kl_push")
    parser.add_argument("--lr-follow", action="store_true",
                        help="the budget's runs with kl_adaptive_lr, recorded in leash_lrfollow.jsonl (tables.py "
                             "pairs them with the plain budget's runs of leash.jsonl)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.prompts, args.group, args.max_new_tokens = 3, 2, 2, 8
    results: dict = {}
    begin = time.perf_counter()
    print("| setting | controller | push | seed | steps 5-16 in band | final KL | reward gain | kept over kl_bound | "
          "rejected | largest KL / target |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    grid = settings(args.quick)
    if args.settings:
        grid = [grid[int(i) - 1] for i in args.settings.split(",")]
    pushes = {"on": [True], "off": [False], "both": [True, False]}[args.push]
    for setting in grid:
        for controller in args.controllers.split(","):
            for push in pushes if controller == "budget" else [True]:
                for seed in (int(x) for x in args.seeds.split(",")):
                    res = row(run_one(setting, controller, seed, push, args), args.kl_target)
                    results[setting.name, controller] = res
                    print(f"| {setting.name} | {controller} | {'on' if push else 'off'} | {seed} | {res['in_band']:.0%} | "
                          f"{res['final_kl']:.2f} | {res['reward_gain']:+.3f} | {res['over_bound']} | {res['rejected']} | "
                          f"{res['peak']:.2f} |", flush=True)
    path = Path(args.out) / "leash.png"
    plot(results, args.controllers.split(","), args.kl_target, path)
    print(f"\nkl_target {args.kl_target} nats/answer, band +-{TARGET_BAND:.0%}; plot: {path}; "
          f"{time.perf_counter() - begin:.0f} s")


if __name__ == "__main__":
    main()
