"""The KL estimator grid on the default task: final held-out accuracy and held-out sampled KL per form.

Each variant is a default ``tether train`` run (the embedded model, the arithmetic task) with only
the leash's form changed, at a constant beta (``--beta``) so the estimator, not a controller, sets
the KL; two rows hold the default budget leash instead (the grid, read: docs/objectives.md):

    k1-reward        kl_mode=reward kl_estimator=k1        k1 in the reward (reward-to-go), after the group norm (recipe.add_advantages)
    k3-loss          kl_estimator=k3 kl_correction=none    the raw k3 as a loss (GRPO paper, TorchRL)
    k3-ratio         kl_estimator=k3 kl_correction=importance   w k3 with w = pi / pi_sampler in the graph
    k2-ratio         kl_estimator=k2 kl_correction=importance   sg(w) k2: its gradient w k1 grad log pi is
                                                           OpenRLHF's unbiased-gradient option (PR 1309)
    exact-loss       kl_mode=exact                         the exact full-vocabulary KL per token as the loss
    dppo-tv          k3-ratio + trust_region=dppo_tv       DPPO's TV mask instead of the ratio clip
    budget, dppo-tv-budget   kl_controller=budget (the default leash), with the clip / DPPO's mask

One JSON line per run goes to ``<--results>/estimators.jsonl`` (default ``benchmarks/results``;
``--quick`` records only into a ``--results`` given); a run whose ``summary.json`` exists is read, not re-run.

    python benchmarks/estimators.py --device cuda --dtype bfloat16 --threads 1 --jobs 8 --seeds 0,1,2,3
    python benchmarks/estimators.py --quick --out /tmp/est      # tiny model, 2 steps: a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402
from _jobs import job_pool  # noqa: E402
from _stats import interval  # noqa: E402

from tether.train.config import TrainConfig  # noqa: E402
from tether.train.flags import parse_overrides  # noqa: E402
from tether.train.recipe import train  # noqa: E402

CONSTANT = {"kl_controller": "constant"}  # beta from --beta
_K3_RATIO = {**CONSTANT, "kl_mode": "loss", "kl_estimator": "k3", "kl_correction": "importance"}
VARIANTS: dict[str, dict] = {
    "k1-reward": {**CONSTANT, "kl_mode": "reward", "kl_estimator": "k1"},
    "k3-loss": {**CONSTANT, "kl_mode": "loss", "kl_estimator": "k3", "kl_correction": "none"},
    "k3-ratio": _K3_RATIO,
    "k2-ratio": {**CONSTANT, "kl_mode": "loss", "kl_estimator": "k2", "kl_correction": "importance"},
    "exact-loss": {**CONSTANT, "kl_mode": "exact"},
    "dppo-tv": {**_K3_RATIO, "trust_region": "dppo_tv"},
    "budget": {"kl_controller": "budget"},
    "dppo-tv-budget": {"kl_controller": "budget", "trust_region": "dppo_tv"},
}
QUICK = {"model": "tiny", "steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "eval_size": 4,
         "eval_max_new_tokens": 4, "micro_batch_size": 4}
SUMMARY_KEYS = ("accuracy_before", "accuracy_after", "eval_kl_sampled_per_seq", "eval_kl_per_seq",
                "final_train_kl_exact_per_seq", "steps_over_kl_bound", "seconds_this_process")
CONFIG_KEYS = ("model", "task", "steps", "prompts_per_step", "group_size", "learning_rate", "eval_size", "kl_coef",
               "kl_controller", "kl_target", "kl_mode", "kl_estimator", "kl_correction", "trust_region",
               "trust_region_delta", "dtype", "device")


def config(variant: str, seed: int, args: argparse.Namespace) -> TrainConfig:
    """The run's config: the defaults, ``--beta``, the variant's keys, then ``--set``."""
    base = TrainConfig(seed=seed, threads=args.threads, device=args.device, dtype=args.dtype, kl_coef=args.beta,
                       out=str(Path(args.out) / f"{variant}-s{seed}"), overwrite=True)
    return base.override({**(QUICK if args.quick else {}), **VARIANTS[variant],
                          **parse_overrides(args.set)}).validate()


def run_variant(variant: str, seed: int, args: argparse.Namespace) -> dict:
    """The run's record (training it first unless its ``summary.json`` exists)."""
    cfg = config(variant, seed, args)
    out = Path(cfg.out)
    stamp = _results.stamp()  # the code the run ran, not the code when it ended
    if not (out / "summary.json").is_file():
        train(cfg, progress=False)
    summary = json.loads((out / "summary.json").read_text())
    return {"variant": variant, "seed": seed, **stamp, "config": {k: getattr(cfg, k) for k in CONFIG_KEYS},
            **{k: summary.get(k) for k in SUMMARY_KEYS},
            "per_problem_after": summary.get("per_problem_after"),
            "clip_fraction": [json.loads(line).get("clip_fraction") for line in (out / "metrics.jsonl").open()]}


def table(records: list[dict]) -> list[str]:
    """A markdown row per variant and device: mean and 95 % t interval over its seeds (CPU and GPU
    runs differ in dtype and kernels, so their seeds are not pooled)."""
    lines = ["| variant | device | seeds | held-out accuracy (%) | held-out sampled KL / answer | mean cut fraction |",
             "|---|---|---|---|---|---|"]
    devices = sorted({r["config"]["device"] for r in records})
    for variant in VARIANTS:
        for device in devices:
            runs = [r for r in records if r["variant"] == variant and r["config"]["device"] == device]
            if not runs:
                continue
            acc = interval([100 * r["accuracy_after"] for r in runs])
            kl = interval([r["eval_kl_sampled_per_seq"] for r in runs])
            cut = [c for r in runs for c in r["clip_fraction"]]
            lines.append(f"| {variant} | {device} | {', '.join(str(r['seed']) for r in runs)} | "
                         f"{acc[0]:.1f} [{acc[1]:.1f}, {acc[2]:.1f}] | {kl[0]:.3f} [{kl[1]:.3f}, {kl[2]:.3f}] | "
                         f"{sum(cut) / len(cut):.3f} |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    parser.add_argument("--seeds", default="0,1,2,3", help="comma-separated seeds")
    parser.add_argument("--beta", type=float, default=0.1, help="kl_coef of the constant-beta rows (the budget's start)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides on every run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process")
    parser.add_argument("--out", default="runs/estimators")
    parser.add_argument("--results", default=None,
                        help="folder of estimators.jsonl (default benchmarks/results; with --quick: no record)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps, 4 held-out problems")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; expected some of {list(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    grid = [(v, int(s)) for v in args.variants.split(",") for s in args.seeds.split(",")]
    records, root = [], args.results or (None if args.quick else _results.RESULTS)
    # A run that fails is named and left out. Each record is written as its run ends, so a grid
    # cut short (a GPU call's limit) keeps what finished.
    with job_pool(args.jobs) as pool:
        futures = {pool.submit(run_variant, v, s, args): (v, s) for v, s in grid}
        # In one process every job is done on submission: take them in the grid's order, not as_completed's.
        for future in futures if args.jobs == 1 else as_completed(futures):
            try:
                records.append(future.result())
            except Exception as exc:  # noqa: BLE001 - one broken run must not lose the others
                print(f"{'-s'.join(map(str, futures[future]))}: failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            if root is not None:
                _results.write("estimators", records[-1], key=("variant", "seed", "config", "commit", "machine"),
                               root=Path(root))
    records.sort(key=lambda r: grid.index((r["variant"], r["seed"])))
    print("\n".join(table(records)), flush=True)
    return records


if __name__ == "__main__":
    main()
