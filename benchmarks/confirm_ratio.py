"""How well the budget's cheap reading after a move predicts the full one.

A reading after a move (``hold_kl_budget``) reads every ``CONFIRM_EVERY``-th group only and
scales the first reading's level by those groups' paired ratio, ``mean(b) * sum(a[S]) /
sum(b[S])``. This script trains the default run's first ``--steps`` steps (no budget move, so
the KL grows as the update leaves it), and after each update reads every answer's exact KL at
the updated weights (``b``) and at scales ``--scales`` along the line to the reference (``a``).
Printed per step and scale: the full readings' ratio, the spread of the per-answer ratios
(coefficient of variation), and the error of the paired-ratio estimate against the full
reading for ``S`` = every third group (the shipped rule), and for ``--draws`` random picks of a
half, a third and a quarter of the groups (mean and largest absolute error).

    python benchmarks/confirm_ratio.py [--steps 3] [--scales 0.7,1.4] [--threads 1]
"""

from __future__ import annotations

import argparse
import random

import torch

from tether.train.config import TrainConfig
from tether.train.recipe import add_advantages, add_reference, optimize, sample, score_rewards, step_problems
from tether.train.run import build_run
from tether.train.updates import CONFIRM_EVERY, answer_kl, confirm_rows


def estimate_error(before: torch.Tensor, after: torch.Tensor, rows: torch.Tensor) -> float:
    """Relative error of the paired-ratio estimate on ``rows`` against the full reading."""
    estimate = before.mean() * after[rows].sum() / before[rows].sum()
    return float(estimate / after.mean() - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--scales", default="0.7,1.4")
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    run = build_run(TrainConfig(threads=args.threads, out="runs/confirm_ratio", eval_size=0, overwrite=True))
    pick = random.Random(0)
    print("| step | scale | KL before | full ratio | per-answer ratio CV | every third group | "
          "random half: mean / max | third | quarter |")
    print("|---|---|---|---|---|---|---|---|---|")
    for step in range(args.steps):
        problems = step_problems(run, step)
        record = sample(run, problems, step)
        score_rewards(run, record, problems, step)
        add_reference(run, record)
        add_advantages(run, record)
        optimize(run, record, step)
        run.line.capture()
        with torch.no_grad():
            before = answer_kl(run.actor, record)
            groups = sorted(set(record.group_ids.tolist()))
            for scale in map(float, args.scales.split(",")):
                run.line.place(scale)
                after = answer_kl(run.actor, record)
                ratios = after / before
                cells = []
                for share in (1 / 2, 1 / 3, 1 / 4):
                    errors = []
                    for _ in range(args.draws):
                        kept = pick.sample(groups, max(1, round(share * len(groups))))
                        errors.append(abs(estimate_error(before, after, torch.isin(record.group_ids, torch.tensor(kept)))))
                    cells.append(f"{100 * sum(errors) / len(errors):.1f} % / {100 * max(errors):.1f} %")
                shipped = estimate_error(before, after, confirm_rows(record, CONFIRM_EVERY))
                print(f"| {step + 1} | {scale:g} | {float(before.mean()):.3f} | {float(after.mean() / before.mean()):.3f} | "
                      f"{float(ratios.std() / ratios.mean()):.3f} | {100 * shipped:+.1f} % | {' | '.join(cells)} |", flush=True)
            run.line.place(1.0)


if __name__ == "__main__":
    main()
