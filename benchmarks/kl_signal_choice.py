"""Which KL the budget should read: the step's own answers, or a fixed probe set.

Both are the exact full-vocabulary KL per answer of the policy to the reference. The step's own
answers are fresh samples of the policy, the same distribution as the next step's batch, on
which the leash is judged; a fixed probe set (answers sampled once, at the start, from the
untrained policy, which is the reference) has no sampling noise but follows the reference's
answers, not the policy's. This script measures both on a trained run's newest checkpoint: the
KL on ``--batches`` fresh default batches (its mean and spread: the noise of a one-batch signal)
against the probe set's KL (its gap to that mean: the probe's bias).

    python benchmarks/kl_signal_choice.py RUN_DIR [--batches 4]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tether.train.checkpoint import open_checkpoint
from tether.train.run_dir import RESUMABLE_KEYS, read_run_config
from tether.train.recipe import add_reference, sample, step_problems
from tether.train.run import build_run
from tether.train.updates import answer_kl


@torch.no_grad()
def batch_kl(run, step: int) -> float:
    """The exact KL per answer of the policy on the answers it samples for ``step``'s prompts."""
    record = sample(run, step_problems(run, step), step)
    add_reference(run, record)
    return float(answer_kl(run.actor, record).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args()
    cfg = read_run_config(args.run_dir)
    run = build_run(cfg)
    with torch.no_grad():  # the probe set: answers of the untrained policy, fixed once
        probe = sample(run, step_problems(run, 10_000), 10_000)
        add_reference(run, probe)
    ckpt, _ = open_checkpoint(cfg, run.models, run.optimizer, allowed=(*RESUMABLE_KEYS, "eval_size"))
    fresh = [batch_kl(run, ckpt.step + i) for i in range(args.batches)]
    probe_kl = float(answer_kl(run.actor, probe).mean())
    mean, sd = statistics.mean(fresh), statistics.stdev(fresh)
    print(f"| signal | KL per answer (nats) at step {ckpt.step} | spread over batches |")
    print("|---|---|---|")
    print(f"| the step's own answers ({len(fresh)} fresh batches of {len(probe)}) | "
          f"{mean:.3f} (each: {', '.join(f'{k:.3f}' for k in fresh)}) | sd {sd:.3f} ({100 * sd / mean:.0f} %) |")
    print(f"| fixed probe set ({len(probe)} answers of the untrained policy) | {probe_kl:.3f} | 0 (fixed) |")
    print(f"probe / fresh mean: {probe_kl / mean:.2f}")


if __name__ == "__main__":
    main()
