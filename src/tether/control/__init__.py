"""KL coefficient controllers (constant, adaptive, target) that drive any component with a ``kl_coef``."""

from tether.control.controllers import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    ConstantKLController,
    KLController,
    TargetKLController,
    make_kl_controller,
)

__all__ = [
    "KL_CONTROLLERS",
    "AdaptiveKLController",
    "ConstantKLController",
    "KLController",
    "TargetKLController",
    "make_kl_controller",
]
