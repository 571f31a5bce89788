"""``ReferenceLine``: a policy's trainable weights on the line through its reference,
``theta(s) = theta_ref + s * (theta - theta_ref)``, for the KL budget's move.

``s = 0`` is the reference, ``s = 1`` the weights as captured (restored bit for bit), ``s > 1``
beyond them. A LoRA policy whose reference is its adapter switched off scales each adapter's
``lora_B`` by ``s``: the adapted weight ``W + scale * B @ A`` then moves exactly along the line
from ``W``, and ``lora_A`` stays. Any other reference (a full fine-tuning copy, a moving
``sync``/``ema`` one) is paired parameter by parameter, as ``ReferenceUpdater`` pairs them; for
a LoRA policy with its own reference copy that interpolates the factors, which is exact at
``s = 0`` and ``s = 1`` only. Sharded (FSDP2) parameters move shard by shard.
"""

from __future__ import annotations

import torch
from torch import nn

from tether.models.reference import AdapterDisabledReference, tracked_pairs

__all__ = ["ReferenceLine"]


class ReferenceLine:
    """The trainable weights of ``policy`` on the line from ``reference`` through their current values."""

    def __init__(self, policy: nn.Module, reference: nn.Module) -> None:
        if isinstance(reference, AdapterDisabledReference):
            self._pairs = _adapter_pairs(policy)
        else:
            self._pairs = [(param, anchor) for param, anchor in tracked_pairs(policy, reference).values()]
        self._captured: list[torch.Tensor] | None = None

    @torch.no_grad()
    def capture(self) -> None:
        """Take the current weights as ``s = 1`` (a copy of each moved tensor)."""
        self._captured = [param.detach().clone() for param, _ in self._pairs]

    @torch.no_grad()
    def place(self, scale: float) -> None:
        """Set the weights to ``theta_ref + scale * (captured - theta_ref)``."""
        if self._captured is None:
            raise RuntimeError("ReferenceLine.place: nothing captured; call capture() after the optimizer step first.")
        for (param, anchor), value in zip(self._pairs, self._captured):
            if scale == 1.0:
                param.copy_(value)
            elif anchor is None:
                param.copy_(value * scale)
            else:
                param.copy_(torch.lerp(anchor.to(value.dtype), value, scale))


def _adapter_pairs(policy: nn.Module) -> list[tuple[torch.Tensor, None]]:
    """The ``lora_B`` factors of a policy whose reference is its adapter switched off (anchor 0)."""
    pairs, other = [], []
    for name, param in policy.named_parameters():
        if not param.requires_grad:
            continue
        if "lora_B" in name:
            pairs.append((param, None))
        elif "lora_A" not in name:
            other.append(name)
    if other or not pairs:
        raise ValueError(
            f"policy: the KL budget moves a LoRA policy along the line from its adapter-free reference by "
            f"scaling lora_B, but trainable parameters {other[:3] or 'none named lora_B'} are not LoRA factors; "
            "train only LoRA factors, or use a frozen_copy reference (lora_rank=0 or reference_update=sync)."
        )
    return pairs
