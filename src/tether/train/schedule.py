"""Learning-rate schedules of ``tether train``: linear warm-up, then constant, linear or cosine decay.

The unit is the training step (one rollout), the unit of ``steps`` and ``checkpoint_every``:
with ``updates_per_rollout > 1`` every update of a step uses that step's learning rate. The
multiplier of step ``s`` (0-based, the step being taken) is ``(s + 1) / (warmup + 1)`` during
warm-up, so the first step already moves the weights, and afterwards ``f(p)`` with
``p = (s - warmup) / (steps - warmup)`` the fraction of the decay done: ``1`` (constant),
``1 - p`` (linear) or ``(1 + cos(pi p)) / 2`` (cosine). The scheduler's state is saved in the
checkpoint. The horizon is the run's ``steps``: extending a run with ``--resume --steps N``
stretches the rest of the decay over the new horizon.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from tether.ops.registry import lookup

LR_SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda done: 1.0,
    "linear": lambda done: 1.0 - done,
    "cosine": lambda done: 0.5 * (1.0 + math.cos(math.pi * done)),
}


def lr_multiplier(step: int, *, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Factor on the base learning rate for the 0-based ``step`` of a run of ``total_steps``."""
    decay = lookup(LR_SCHEDULES, schedule, "lr_schedule")
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    span = max(total_steps - warmup_steps, 1)
    return decay(min((step - warmup_steps) / span, 1.0))


def make_lr_scheduler(optimizer: torch.optim.Optimizer, *, schedule: str, warmup_steps: int,
                      total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` stepped once per training step; its ``last_epoch`` is the next step's index."""
    lookup(LR_SCHEDULES, schedule, "lr_schedule")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(step, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps),
    )
