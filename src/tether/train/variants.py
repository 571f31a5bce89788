"""The leash's variants beyond the budget's line search, hooked into the step after ``hold_kl_budget``.

``reference_move`` (a reference that moves when the budget binds): the run keeps the original
model beside the reference the budget holds to (a frozen copy; with a new LoRA adapter, the
adapter switched off). After the budget's move, once the reference has moved at least once, the
kept weights' KL per answer to the original is read on the step's answers and, above
``reference_move_budget``, pulled back along the line to the original (``pull_under_ceiling``,
the ceiling's own mechanism); then ``ReferenceMover`` counts the step and moves the reference
after ``reference_move_after`` pulled-back steps in a row. Before
the first move the reference is the original, so the reading is the budget's own
(``kl_kept_per_seq``) and no forward is spent. ``kl_adaptive_lr`` (a learning rate that follows
the budget): ``BudgetLR`` scales the next step's learning rate by the scale the budget kept.
Why: docs/leash.md, "A reference that moves" and "A learning rate that follows the budget".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tether.control.budget import BudgetMove, ReferenceLine, pull_under_ceiling
from tether.control.reference_move import ReferenceMover
from tether.models import TransformersWrapper, adapter_disabled, frozen_copy
from tether.models.records import StepRecord
from tether.train.updates import KLReadings, TrackedLine

__all__ = ["BudgetLR", "MovingReference", "budget_lr", "hold_original_budget", "hold_variants", "moving_reference", "original_model"]


@dataclass
class MovingReference:
    """reference_move's parts: the mover, the original model, its scorer and the line to it."""

    mover: ReferenceMover
    original: nn.Module
    scorer: TransformersWrapper
    line: ReferenceLine
    budget: float


def moving_reference(cfg: Any, models: Any) -> MovingReference | None:
    """The parts for ``cfg.reference_move`` (None when off), built before any checkpoint is loaded,
    so ``original`` is the model the run started from."""
    if cfg.reference_move == "off":
        return None
    # A new adapter starts at lora_B = 0: the original is the adapter switched off (no copy), and
    # the line to it scales lora_B, which is the adapted weights' own line.
    fresh_adapter = cfg.lora_rank and not cfg.adapter  # build_models' own branches
    original = adapter_disabled(models.policy) if fresh_adapter else frozen_copy(models.policy)
    mover = ReferenceMover(models.policy, models.movable_reference, mode=cfg.reference_move,
                           after=cfg.reference_move_after, alpha=cfg.reference_move_alpha)
    scorer = TransformersWrapper(original, models.tokenizer, input_mode="tokens", generate=False,
                                 temperature=cfg.temperature, log_probs_key="ref_log_probs")
    return MovingReference(mover, original, scorer, ReferenceLine(models.policy, original), cfg.reference_move_budget)


def original_model(run: Any) -> nn.Module:
    """The model the held-out KL is measured to: the original when the reference moves."""
    return run.models.reference if run.moving is None else run.moving.original


@torch.no_grad()
def hold_original_budget(run: Any, record: StepRecord, kept: float) -> dict[str, Any]:
    """The kept weights' KL per answer to the original model, pulled under the cumulative budget
    (``kept``: their KL to the reference, the reading before any move)."""
    moving = run.moving
    if moving.mover.moves == 0:
        return {"kl_to_base_per_seq": kept, "kl_to_base_scale": 1.0}
    scored = moving.scorer.score(record.tokens, record.attention_mask, where=record.assistant_mask,
                                 keep_hidden=record.ref_hidden is not None)
    to_base = dataclasses.replace(record, ref_log_probs=scored.log_probs.to(record.tokens.device),
                                  ref_hidden=scored.hidden)
    readings = KLReadings(run, to_base, confirm_every=1)  # every reading reads every answer
    kl, scale = readings(full=True), 1.0
    if kl > moving.budget:
        try:
            scale, kl, _ = pull_under_ceiling(TrackedLine(moving.line, readings), readings, kl,
                                              ceiling=moving.budget)
        finally:
            moving.line.release()
    return {"kl_to_base_per_seq": kl, "kl_to_base_scale": scale}


# A rejected update kept no scale of its own: the next rate is halved, the most one ceiling try pulls.
REJECTED_SCALE = 0.5
# A step the budget did not pull back raises the multiplier by this factor, up to 1 (the schedule's
# own rate): the factor of the KL-adaptive rate of rl_games' PPO, which this rule follows.
RECOVERY = 1.5


@dataclass
class BudgetLR:
    """The multiplier on the schedule's learning rate: times ``scale ** gain`` after a pulled-back
    step (``REJECTED_SCALE`` for a rejection), times ``RECOVERY ** gain`` (at most 1) otherwise."""

    gain: float
    multiplier: float = 1.0

    def observe(self, move: BudgetMove) -> float:
        if move.rejected or move.scale < 1.0:
            factor = REJECTED_SCALE if move.rejected else move.scale
        else:
            factor = RECOVERY
        self.multiplier = min(1.0, self.multiplier * factor ** self.gain)
        return self.multiplier


def budget_lr(cfg: Any) -> BudgetLR | None:
    return BudgetLR(cfg.kl_adaptive_lr_gain) if cfg.kl_adaptive_lr else None


def hold_variants(run: Any, record: StepRecord, move: BudgetMove | None) -> dict[str, Any]:
    """After ``hold_kl_budget`` (its ``move``) and the schedule's step: the variants' holds and
    moves, and their record entries; ``{}`` with none on."""
    out: dict[str, Any] = {}
    if move is None:
        return out
    if run.moving is not None:
        out.update(hold_original_budget(run, record, move.kl_kept))
        out.update(run.moving.mover.metrics(run.moving.mover.observe(move)))
    if run.lr_follow is not None:  # after the scheduler's step, which sets each rate from its base afresh
        out["lr_multiplier"] = run.lr_follow.observe(move)
        for group in run.optimizer.param_groups:
            group["lr"] *= out["lr_multiplier"]
    return out
