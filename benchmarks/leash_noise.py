"""How far a step's batch KL can sit from its target when the weights do not move at all.

The leash benchmark scores each step on the exact KL per answer of that step's own batch, a
few prompts the weights have not seen. This script holds the weights of a finished run (its
newest checkpoint) fixed and draws ``--batches`` fresh batches of the run's own size (new
prompts of the training stream, new answers), each scored for its mean exact KL per answer.

Printed per run: the mean batch KL, the standard deviation of ``log KL`` over the batches, and
two ceilings on the benchmark's "in band" share (within +-25 % of the target) that no
controller acting between steps can pass at these weights: ``aimed at the mean``, the share of
batches within the band around the batches' mean KL (a perfect aim, known in advance), and
``aimed at one batch``, the share of ordered pairs of batches where the second lies within the
band around the first (what a controller that lands the weights on the step's own batch, as
the budget does, can at best expect of the next one). ``--pools 1,2,4`` also scores batches of
2 and 4 times the run's size (each the mean of that many consecutive batches, all of one size), and
``--record`` keeps each run's batch KLs in ``benchmarks/results/leash_noise.jsonl`` for the docs.

    python benchmarks/leash_noise.py RUN_DIR [RUN_DIR ...] --batches 32 --pools 1,2,4 --record
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

import _results

from tether.train.checkpoint import open_checkpoint
from tether.train.run_dir import RESUMABLE_KEYS, read_run_config
from tether.train.plots import TARGET_BAND
from tether.train.recipe import add_reference, sample, step_problems
from tether.train.run import build_run
from tether.train.updates import answer_kl

FIRST_STEP = 10_000  # draws prompts far past any step a run trained on


def batch_kls(run_dir: Path, batches: int) -> list[float]:
    """Mean exact KL per answer of ``batches`` fresh batches at the run's newest checkpoint."""
    cfg = read_run_config(run_dir).override({"eval_size": 0})
    run = build_run(cfg)
    open_checkpoint(cfg, run.models, run.optimizer, allowed=(*RESUMABLE_KEYS, "eval_size"))
    out = []
    with torch.no_grad():
        for k in range(batches):
            record = sample(run, step_problems(run, FIRST_STEP + k), FIRST_STEP + k)
            add_reference(run, record)
            out.append(float(answer_kl(run.actor, record).mean()))
    return out


def ceilings(kls: list[float]) -> dict[str, float]:
    low, high = 1 - TARGET_BAND, 1 + TARGET_BAND
    mean = statistics.fmean(kls)
    logs = [math.log(k) for k in kls]
    pairs = [(a, b) for i, a in enumerate(kls) for j, b in enumerate(kls) if i != j]
    return {
        "mean": mean,
        "sd_log": statistics.stdev(logs),
        "aimed_at_mean": sum(low <= k / mean <= high for k in kls) / len(kls),
        "aimed_at_one_batch": sum(low <= b / a <= high for a, b in pairs) / len(pairs),
    }


def pooled(kls: list[float], k: int) -> list[float]:
    """Batch KLs of batches ``k`` times as large: the mean of each run of ``k`` consecutive batches
    (equal-sized batches, so the mean of their means is the mean over all their answers)."""
    return [statistics.fmean(kls[i:i + k]) for i in range(0, len(kls) - k + 1, k)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories with a checkpoint")
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pools", default="1", help="batch sizes as multiples of the run's, comma-separated")
    parser.add_argument("--record", action="store_true", help="write each run's batch KLs to results/leash_noise.jsonl")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pools = [int(k) for k in args.pools.split(",")]
    print("| run | answers a batch | batches | mean batch KL | sd of log KL | in band, aimed at the mean "
          "| in band, aimed at one batch |")
    print("|---|---|---|---|---|---|---|")
    for run_dir in map(Path, args.runs):
        kls = batch_kls(run_dir, args.batches)
        cfg = read_run_config(run_dir)
        answers = cfg.prompts_per_step * cfg.group_size
        for k in pools:
            c = ceilings(pooled(kls, k))
            print(f"| {run_dir.name} | {k * answers} | {len(kls) // k} | {c['mean']:.2f} | {c['sd_log']:.2f} | "
                  f"{100 * c['aimed_at_mean']:.0f} % | {100 * c['aimed_at_one_batch']:.0f} % |", flush=True)
        if args.record:
            _results.write("leash_noise", {
                **_results.stamp(), "run": run_dir.name, "learning_rate": cfg.learning_rate, "kl_coef": cfg.kl_coef,
                "kl_mode": cfg.kl_mode, "kl_push": cfg.kl_push, "seed": cfg.seed, "kl_target": cfg.kl_target,
                "answers": answers, "batch_kls": kls}, key=("run",))


if __name__ == "__main__":
    sys.exit(main())
