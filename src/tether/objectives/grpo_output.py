"""``GRPOLossOutput``: the typed record ``GRPOLoss`` returns.

A ``tensordict`` tensorclass with the seed's field names, so TorchRL-style code that calls
``to_tensordict()`` or reads ``out.loss_objective`` keeps working. Every ``loss_*`` field
is differentiable and already reduced; every other field is a detached diagnostic.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from tensordict import tensorclass

LOSS_FIELDS = ("loss_objective", "loss_entropy", "loss_kl_to_ref", "loss_kl_to_inference")


@tensorclass(nocast=True)
class GRPOLossOutput:
    """Scalars of one ``GRPOLoss`` call.

    Attributes:
        loss_objective: clipped surrogate, reduced with the loss's aggregation mode.
        clip_fraction: fraction of valid tokens whose gradient a clip cut.
        kl_approx: masked mean of ``log pi_old - log pi`` (the ratio's denominator minus
            the current log-prob), a k1 estimate of ``KL(pi_old || pi)``.
        ESS: effective sample size of the per-token weights ``pi / pi_sampler`` over the
            valid tokens, divided by their number (1 when all weights are equal).
        entropy: masked mean entropy of the current policy (``None`` without the bonus).
        loss_entropy: ``-entropy_coeff * aggregate(entropy)`` (``None`` without the bonus).
        loss_kl_to_ref: ``kl_to_ref_coeff * aggregate(KL term)`` (``None`` when disabled).
        kl_to_ref: masked mean of the per-token KL estimate to the reference.
        loss_kl_to_inference: ``kl_to_inference_coeff * aggregate(KL term)`` to the
            sampling policy (``None`` when disabled).
        kl_to_inference: masked mean of the per-token KL estimate to the sampling policy.
    """

    loss_objective: Tensor
    clip_fraction: Tensor
    kl_approx: Tensor
    ESS: Tensor
    entropy: Optional[Tensor] = None
    loss_entropy: Optional[Tensor] = None
    loss_kl_to_ref: Optional[Tensor] = None
    kl_to_ref: Optional[Tensor] = None
    loss_kl_to_inference: Optional[Tensor] = None
    kl_to_inference: Optional[Tensor] = None

    def total_loss(self) -> torch.Tensor:
        """Sum of the ``loss_*`` terms that are present: the scalar to call ``backward`` on."""
        total = self.loss_objective
        for name in LOSS_FIELDS[1:]:
            term = getattr(self, name)
            if term is not None:
                total = total + term
        return total

    @property
    def loss(self) -> torch.Tensor:
        """Alias of ``total_loss()``."""
        return self.total_loss()
