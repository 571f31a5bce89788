"""Power-of-two rescaling that keeps sums of large (or tiny) values inside the dtype.

Sums of float32 values near 1e38 overflow although their mean fits; sums of squares of
values near 1e-30 underflow. Dividing by a power of two is exact, so a reduction run on
``x / scale`` and multiplied back gives the very numbers an unscaled one gives wherever
that one did not overflow or underflow.
"""

from __future__ import annotations

import torch
from torch import Tensor


def power_of_two_scale(magnitude: Tensor) -> Tensor:
    """``2^e`` with ``scale <= magnitude < 2 * scale``; 1 where magnitude is 0 or not finite.

    Args:
        magnitude: ``[...]`` non-negative largest absolute values.

    Returns:
        ``[...]`` powers of two in the dtype of ``magnitude``, detached.
    """
    magnitude = magnitude.detach()
    _, exponent = torch.frexp(magnitude)
    scale = torch.ldexp(torch.ones_like(magnitude), exponent - 1)
    usable = torch.isfinite(magnitude) & (magnitude > 0)
    return torch.where(usable, scale, torch.ones_like(magnitude))
