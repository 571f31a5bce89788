"""How closely ``final_kl_target``'s search lands on its target, and what it spends.

Trains the default run's first ``--steps`` steps with constant beta 0 (nothing holds the KL), then,
on the last step's answers, lands the trained weights at each fraction ``--fractions`` of their
KL with ``tether.train.averaging.land_on_target`` (from the trained weights each time). Printed
per target: the lambda kept, the KL landed over the target (the search keeps the first reading
in 0.951-1), and the KL readings it spent (each a policy forward over the step's answers).

    python benchmarks/final_land.py [--steps 3] [--learning-rate 1e-3] [--fractions 0.75,0.5,0.25,0.1] [--model default]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import unleashed_step  # noqa: E402

from tether.control.budget import ReferenceLine  # noqa: E402
from tether.train.averaging import land_on_target  # noqa: E402
from tether.train.config import TrainConfig  # noqa: E402
from tether.train.run import build_run  # noqa: E402
from tether.train.updates import answer_kl  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--fractions", default="0.75,0.5,0.25,0.1")
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    cfg = TrainConfig(model=args.model, threads=args.threads, out="runs/final_land", eval_size=0, overwrite=True,
                      learning_rate=args.learning_rate, kl_controller="constant", kl_coef=0.0, kl_bound=0.0)
    run = build_run(cfg)
    for step in range(args.steps):
        record = unleashed_step(run, step)
    params = [p for p in run.models.policy.parameters() if p.requires_grad]
    trained = [p.detach().clone() for p in params]
    line = ReferenceLine(run.models.policy, run.models.reference)
    with torch.no_grad():
        kl_trained = float(answer_kl(run.actor, record).mean())
    print(f"model {args.model}, {args.steps} steps at lr {args.learning_rate:g}, beta 0: KL per answer {kl_trained:.3f}")
    print("| target / trained KL | target (nats) | lambda | landed / target | readings |")
    print("|---|---|---|---|---|")
    for fraction in map(float, args.fractions.split(",")):
        with torch.no_grad():
            for param, value in zip(params, trained):
                param.copy_(value)
        target = fraction * kl_trained
        move = land_on_target(run, record, line, target)
        print(f"| {fraction:g} | {target:.3f} | {move.scale:.4f} | {move.kl_kept / target:.4f} | {move.forwards} |",
              flush=True)


if __name__ == "__main__":
    main()
