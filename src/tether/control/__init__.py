"""KL coefficient controllers (constant, adaptive, target) that drive any component with a ``kl_coef``,
and the KL budget (``budget``) that also moves the update."""

from tether.control.budget import BudgetMove
from tether.control.controllers import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    BudgetKLController,
    ConstantKLController,
    KLController,
    TargetKLController,
    make_kl_controller,
)
from tether.control.reference_move import REFERENCE_MOVES, ReferenceMover

__all__ = [
    "KL_CONTROLLERS",
    "AdaptiveKLController",
    "BudgetKLController",
    "BudgetMove",
    "ConstantKLController",
    "KLController",
    "REFERENCE_MOVES",
    "ReferenceMover",
    "TargetKLController",
    "make_kl_controller",
]
