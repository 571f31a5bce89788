"""How well the budget's cheap reading after a move predicts the full one.

A reading after a move (``hold_kl_budget``) reads every ``CONFIRM_EVERY``-th answer of each group
only and scales the first reading's level by those answers' paired ratio, ``mean(b) * sum(a[S])
/ sum(b[S])``. This script trains the default run's first ``--steps`` steps (no budget move, so
the KL grows as the updates leave it), and after each update reads every answer's exact KL at
the updated weights (``b``) and at scales ``--scales`` along the line to the reference (``a``).
Printed per step and scale: the full readings' ratio, the spread of the per-answer ratios
(coefficient of variation), and the error of the paired-ratio estimate against the full reading
for ``S`` = the shipped rule, every third whole group (fewer prompts to read), and ``--draws``
random picks of a third of each group's answers and of a third of the groups (mean and largest
absolute error).

    python benchmarks/confirm_ratio.py [--steps 3] [--scales 0.7,1.4] [--threads 1] [--learning-rate 2e-4]
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import unleashed_step  # noqa: E402

from tether.train.config import TrainConfig  # noqa: E402
from tether.train.run import build_run  # noqa: E402
from tether.train.updates import CONFIRM_EVERY, answer_kl, confirm_rows  # noqa: E402


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
    parser.add_argument("--learning-rate", type=float, default=TrainConfig.learning_rate,
                        help="a larger one reaches the default run's KL of about 3 nats sooner")
    args = parser.parse_args()
    run = build_run(TrainConfig(threads=args.threads, out="runs/confirm_ratio", eval_size=0, overwrite=True,
                                learning_rate=args.learning_rate))
    pick = random.Random(0)
    print("| step | scale | KL before | full ratio | per-answer ratio CV | every third answer of each group (shipped) | "
          "every third group | random third of each group: mean / max | random third of the groups: mean / max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for step in range(args.steps):
        record = unleashed_step(run, step)
        run.line.capture()
        ids = record.group_ids
        groups = sorted(set(ids.tolist()))
        members = [torch.nonzero(ids == g).squeeze(-1).tolist() for g in groups]
        with torch.no_grad():
            before = answer_kl(run.actor, record)
            for scale in map(float, args.scales.split(",")):
                run.line.place(scale)
                after = answer_kl(run.actor, record)
                ratios = after / before

                def spread(draw) -> str:
                    errors = [abs(estimate_error(before, after, torch.tensor(sorted(draw())))) for _ in range(args.draws)]
                    return f"{100 * sum(errors) / len(errors):.1f} % / {100 * max(errors):.1f} %"

                within = spread(lambda: [r for rows in members for r in pick.sample(rows, max(1, round(len(rows) / 3)))])
                whole = spread(lambda: [r for rows in pick.sample(members, max(1, round(len(members) / 3))) for r in rows])
                shipped = estimate_error(before, after, confirm_rows(record, CONFIRM_EVERY))
                third_groups = estimate_error(before, after, torch.tensor([r for rows in members[::3] for r in rows]))
                print(f"| {step + 1} | {scale:g} | {float(before.mean()):.3f} | {float(after.mean() / before.mean()):.3f} | "
                      f"{float(ratios.std() / ratios.mean()):.3f} | {100 * shipped:+.1f} % | {100 * third_groups:+.1f} % | "
                      f"{within} | {whole} |", flush=True)
            run.line.place(1.0)


if __name__ == "__main__":
    main()
