"""Argument checks shared by the rollout classes: typed errors that name the argument."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["check_generated", "per_step"]


def check_generated(generated: Any, size: int, width: int) -> None:
    """``generated`` must be an integer ``[size, width]`` tensor."""
    if not isinstance(generated, Tensor) or generated.is_floating_point() or generated.dtype == torch.bool:
        got = generated.dtype if isinstance(generated, Tensor) else type(generated).__name__
        raise TypeError(f"generated: expected an integer tensor [B, L + N], got {got}. Pass generate(batch).generated.")
    if tuple(generated.shape) != (size, width):
        raise ValueError(
            f"generated: expected shape [B, L + max_new_tokens] = [{size}, {width}], got "
            f"{tuple(generated.shape)}. Pass the output of generate() for this batch."
        )


def per_step(name: str, values: Any, size: int, steps: int) -> Tensor:
    """``values`` as a float ``[size, steps]`` tensor (a trailing singleton dim is dropped)."""
    if not isinstance(values, Tensor) or not values.is_floating_point():
        got = values.dtype if isinstance(values, Tensor) else type(values).__name__
        raise TypeError(f"{name}: expected a float tensor [B, N], got {got}.")
    if values.dim() == 3 and values.shape[-1] == 1:
        values = values.squeeze(-1)
    if tuple(values.shape) != (size, steps):
        raise ValueError(
            f"{name}: expected shape [B, N] = [{size}, {steps}] (or [B, N, 1]), got "
            f"{tuple(values.shape)}. Pass the output of generate() for this batch."
        )
    return values
