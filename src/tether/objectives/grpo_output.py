"""``GRPOTokenTerms`` and ``GRPOLossOutput``: the per-token and the reduced records of ``GRPOLoss``.

``GRPOLoss.token_terms`` returns every term per token; ``GRPOLoss.reduce`` turns them into
a ``GRPOLossOutput`` through ``tether.ops.aggregate``. Because the per-token record of a
batch is the concatenation of its micro-batches' records, a caller that accumulates
gradients over micro-batches gets the full batch's diagnostics exactly (ESS included, which
is not a token mean) by reducing the concatenated detached terms once.

A ``tensordict`` tensorclass with TorchRL's field names, so TorchRL-style code that calls
``to_tensordict()`` or reads ``out.loss_objective`` keeps working. Every ``loss_*`` field
is differentiable and already reduced; every other field is a detached diagnostic.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
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
        kl_to_ref_exact: masked mean of the exact full-vocabulary KL to the reference per
            token (only when the batch carried the reference's hidden states).
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
    kl_to_ref_exact: Optional[Tensor] = None

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


@dataclass
class GRPOTokenTerms:
    """Every term of one ``GRPOLoss`` call, per token, before reduction.

    Every tensor is ``[B, T]`` on the batch's token grid and 0 outside ``mask``. Fields
    marked differentiable carry the graph to the policy (unless ``detach()`` was called).

    Attributes:
        mask: ``bool [B, T]``, the tokens trained on.
        policy: clipped surrogate loss per token (importance-weighted if asked); differentiable.
        clipped: 1.0 where a clip cut the token's gradient, else 0.0.
        ratio_gap: ``log pi_old - log pi`` (detached): its mean is ``kl_approx``.
        log_weights: ``log pi - log pi_sampler`` (detached): the ESS log-weights.
        entropy: policy entropy per token, or ``None`` without the bonus; differentiable
            when the entropy coefficient is non-zero.
        kl_to_ref_term / kl_to_ref: the KL loss term (differentiable) and the detached KL
            estimate against the reference, or ``None`` when that leash is off.
        kl_to_inference_term / kl_to_inference: the same against the sampling policy.
        kl_to_ref_exact: the exact full-vocabulary KL to the reference (detached), or
            ``None`` when the batch carried no reference hidden states.
    """

    mask: Tensor
    policy: Tensor
    clipped: Tensor
    ratio_gap: Tensor
    log_weights: Tensor
    entropy: Optional[Tensor] = None
    kl_to_ref_term: Optional[Tensor] = None
    kl_to_ref: Optional[Tensor] = None
    kl_to_inference_term: Optional[Tensor] = None
    kl_to_inference: Optional[Tensor] = None
    kl_to_ref_exact: Optional[Tensor] = None

    def detach(self) -> "GRPOTokenTerms":
        """The same values cut from the graph (what a caller keeps after ``backward``)."""
        return GRPOTokenTerms(**{
            f.name: None if getattr(self, f.name) is None else getattr(self, f.name).detach() for f in fields(self)
        })

    @classmethod
    def cat(cls, parts: "list[GRPOTokenTerms]") -> "GRPOTokenTerms":
        """Rows of several micro-batches (same ``T``, same terms present) stacked along ``B``."""
        if not parts:
            raise ValueError("GRPOTokenTerms.cat: expected at least one micro-batch's terms; got an empty list.")
        joined = {}
        for f in fields(cls):
            values = [getattr(part, f.name) for part in parts]
            if any((v is None) != (values[0] is None) for v in values):
                raise ValueError(f"GRPOTokenTerms.cat: {f.name!r} is present in some micro-batches and not in others.")
            joined[f.name] = None if values[0] is None else torch.cat(values, dim=0)
        return cls(**joined)
