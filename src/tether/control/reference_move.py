"""``ReferenceMover``: advance the reference when the KL budget keeps binding.

The budget controller pulls an update back (``BudgetMove.scale < 1``) or rejects it when the
updated weights' KL to the reference leaves the band. After ``after`` such steps in a row the
leash is spending every step fighting the same anchor, so the reference advances toward the
kept weights: a hard copy (``"reset"``, Elastic Reset's move, here triggered by the budget and
not by a fixed schedule) or one EMA step (``"ema"``, ``ref <- ref + alpha (policy - ref)``).
The move itself is ``ReferenceUpdater.move_now``: one mechanism moves references in tether.
The cumulative budget to the original model is the trainer's job (``tether.train.variants``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tether.control.budget import BudgetMove
from tether.control.kl_io import check_state_keys
from tether.models.reference import ReferenceUpdater
from tether.ops.checks import lookup, real_number, whole_number

__all__ = ["REFERENCE_MOVES", "ReferenceMover"]

# reference_move's names -> the ReferenceUpdater mode each one applies (off: no mover).
REFERENCE_MOVES: dict[str, str | None] = {"off": None, "reset": "sync", "ema": "ema"}


def pulled_back(move: BudgetMove) -> bool:
    """Whether the budget bound this step: the update was scaled under 1 or rejected."""
    return move.rejected or move.scale < 1.0


class ReferenceMover:
    """Counts consecutive pulled-back steps; at ``after`` of them moves ``reference`` to ``policy``.

    Args:
        policy, reference: as ``ReferenceUpdater`` (``reference`` a ``frozen_copy`` of the policy).
        mode: ``"reset"`` or ``"ema"`` (``REFERENCE_MOVES``).
        after: consecutive pulled-back steps that trigger a move (>= 1); the count restarts after it.
        alpha: the policy's weight in an ``"ema"`` move, in ``(0, 1]``.
    """

    _STATE_KEYS = ("mode", "after", "alpha", "streak", "moves")

    def __init__(self, policy: nn.Module, reference: nn.Module, *, mode: str, after: int,
                 alpha: float | None = None) -> None:
        rule = lookup(REFERENCE_MOVES, mode, "reference_move")
        if rule is None:
            raise ValueError("reference_move: 'off' builds no mover; pass 'reset' or 'ema'.")
        self.mode = mode
        self.after = whole_number("reference_move_after", after, low=1, fix="Pass the pulled-back steps in a row.")
        self.alpha = None if mode == "reset" else real_number(
            "reference_move_alpha", alpha, low=0, low_open=True, high=1, fix="The policy's weight in the EMA step.")
        self.updater = ReferenceUpdater(policy, reference, mode=rule, alpha=self.alpha)
        self.streak = 0  # pulled-back steps in a row since the last move
        self.moves = 0

    def observe(self, move: BudgetMove) -> bool:
        """After the step's leash (weights final): count it; True when the reference moved now."""
        self.streak = self.streak + 1 if pulled_back(move) else 0
        if self.streak < self.after:
            return False
        self.updater.move_now()
        self.streak, self.moves = 0, self.moves + 1
        return True

    def metrics(self, moved: bool) -> dict[str, Any]:
        return {"reference_moved": moved, "reference_moves": self.moves, "reference_move_streak": self.streak}

    def state_dict(self) -> dict[str, Any]:
        """Counters and settings (JSON-able); the moved reference's tensors are the checkpoint's."""
        return {"mode": self.mode, "after": self.after, "alpha": self.alpha, "streak": self.streak,
                "moves": self.moves}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, self._STATE_KEYS, type(self).__name__)
        for key in ("mode", "after", "alpha"):
            if state[key] != getattr(self, key):
                raise ValueError(f"reference_move: the checkpoint's {key}={state[key]!r} differs from this run's "
                                 f"{getattr(self, key)!r}; resume with the settings the run was started with.")
        self.streak = whole_number("streak", state["streak"], low=0)
        self.moves = whole_number("moves", state["moves"], low=0)
