"""Per-token policy-gradient losses: PPO clipped surrogate, GSPO ratio, mismatch weights.

All losses are per token and unreduced; ``aggregate`` reduces them.

Departures from the papers, on purpose:

* The surrogate evaluates ``exp(log_ratio)`` only on tokens whose unclipped branch is the
  one selected. Elsewhere the loss is a constant of the clip bound, so a log-ratio of
  +-100 yields a finite loss and a finite (zero) gradient instead of ``0 * inf = NaN`` in
  backward. Nothing is clamped. The one loss that is genuinely unbounded, ``A < 0`` with a
  large ratio and no dual clip, stays ``r * |A|`` (finite in float64 up to ``r ~ e^709``,
  inf in float32 past ``r ~ e^88``): bounding it is what ``dual_clip`` is for.
* ``clipped`` marks tokens whose gradient is cut by a clip, not tokens whose ratio merely
  lies outside ``[1 - low, 1 + high]`` (with ``A > 0`` and ``r < 1 - low`` PPO keeps the
  gradient).
* GSPO is implemented in its GSPO-token form (the sequence ratio as the value, each
  token's own score as the gradient), which equals sequence-level GSPO when all tokens of
  a sequence share the advantage and lets per-token advantages and masks pass through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Callable

import torch
from torch import Tensor

from tether.ops.checks import lookup, real_number


@dataclass(frozen=True)
class PolicyLoss:
    """Per-token result of a clipped policy loss.

    Attributes:
        loss: ``[B, T]`` per-token loss (to be reduced with ``aggregate``).
        clipped: ``bool [B, T]`` tokens whose gradient a clip cut: ``A > 0`` and
            ``r > 1 + high``, ``A < 0`` and ``r < 1 - low``, or ``A < 0`` and ``r > dual_clip``.
        ratio: ``[B, T]`` ``exp(log_ratio)``, detached, for diagnostics.
    """

    loss: Tensor
    clipped: Tensor
    ratio: Tensor


def clip_bounds(clip_epsilon: float | tuple[float, float]) -> tuple[float, float]:
    """``(low, high)`` of ``clip_epsilon`` after checking them (a loss checks its options with it)."""
    pair = clip_epsilon if isinstance(clip_epsilon, (tuple, list)) else (clip_epsilon, clip_epsilon)
    if len(pair) != 2 or not all(isinstance(v, Real) and not isinstance(v, bool) for v in pair):
        raise TypeError(f"clip_epsilon: expected a number or a (low, high) pair of numbers, got {clip_epsilon!r}.")
    low = real_number("clip_epsilon low", pair[0], low=0, high=1, high_open=True, fix="1 - low must stay > 0.")
    return low, real_number("clip_epsilon high", pair[1], low=0)


def check_dual_clip(dual_clip: float | None) -> None:
    if dual_clip is None:
        return
    real_number("dual_clip", dual_clip, low=1, low_open=True, fix="Ye et al. (2020) use 3; pass None to disable it.")


def _check_advantages(log_ratio: Tensor, advantages: Tensor) -> None:
    if not isinstance(log_ratio, Tensor) or log_ratio.dim() != 2:
        got = tuple(log_ratio.shape) if isinstance(log_ratio, Tensor) else type(log_ratio).__name__
        raise ValueError(f"log_ratio must be a [B, T] tensor; got {got}.")
    rows, cols = log_ratio.shape
    if not isinstance(advantages, Tensor) or advantages.dim() != 2 or advantages.shape[0] != rows or (
        advantages.shape[1] not in (1, cols)
    ):
        got = tuple(advantages.shape) if isinstance(advantages, Tensor) else type(advantages).__name__
        raise ValueError(
            f"advantages must be [B, T] = {(rows, cols)} or [B, 1] = {(rows, 1)}; got {got}. "
            "Use advantages.unsqueeze(-1) for per-sequence advantages [B]."
        )


def clipped_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    *,
    clip_epsilon: float | tuple[float, float] = 0.2,
    dual_clip: float | None = None,
) -> PolicyLoss:
    """PPO clipped surrogate ``-min(r A, clip(r, 1 - low, 1 + high) A)``, per token.

    Args:
        log_ratio: ``[B, T]`` ``log pi - log pi_old`` of the sampled tokens, in the graph.
        advantages: ``[B, T]`` or ``[B, 1]`` (broadcast over tokens), constants.
        clip_epsilon: ``eps`` for a symmetric clip or ``(low, high)`` for clip-higher
            (DAPO); ``0 <= low < 1``, ``high >= 0``.
        dual_clip: ``c > 1`` caps the loss of ``A < 0`` tokens at ``-c A`` (Ye et al.
            2020), i.e. ratios above ``c`` stop pushing; ``None`` disables it.

    Returns:
        ``PolicyLoss`` with ``loss``, ``clipped`` and ``ratio``, all ``[B, T]``.
    """
    _check_advantages(log_ratio, advantages)
    low, high = clip_bounds(clip_epsilon)
    check_dual_clip(dual_clip)
    adv = advantages.detach().expand_as(log_ratio).to(log_ratio.dtype)
    lr = log_ratio.detach()

    cut_high = (adv > 0) & (lr > math.log1p(high))
    cut_low = (adv < 0) & (lr < math.log1p(-low))
    cut_dual = (adv < 0) & (lr > math.log(dual_clip)) if dual_clip is not None else torch.zeros_like(cut_high)
    clipped = cut_high | cut_low | cut_dual

    bound = torch.zeros_like(adv)
    bound = torch.where(cut_high, 1.0 + high, bound)
    bound = torch.where(cut_low, 1.0 - low, bound)
    if dual_clip is not None:
        bound = torch.where(cut_dual, float(dual_clip), bound)
    # Unselected branches see a log-ratio of 0 so their exp stays finite in backward.
    live = ~clipped & (adv != 0)
    ratio_live = torch.exp(torch.where(live, log_ratio, torch.zeros_like(log_ratio)))
    loss = torch.where(live, -ratio_live * adv, -bound * adv)
    return PolicyLoss(loss=loss, clipped=clipped, ratio=torch.exp(lr))


def gspo_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO sequence-level log-ratio (Zheng et al. 2025), broadcast to tokens.

    ``s = sum_t m_t (logp_t - old_logp_t) / sum_t m_t`` per row (the log of the
    length-normalised sequence ratio). Each valid token gets the value ``s`` with the
    gradient of its own ``logp_t`` (GSPO-token: ``sg(s) + logp_t - sg(logp_t)``), so
    ``exp`` of it is ``sg(ratio_seq) * pi_t / sg(pi_t)``.

    Args:
        logp: ``[B, T]`` current log-probs, in the graph.
        old_logp: ``[B, T]`` log-probs of the sampling policy (treated as constant).
        mask: ``bool [B, T]`` valid tokens.

    Returns:
        ``[B, T]`` log-ratio for ``clipped_surrogate``; 0 at masked positions and in rows
        without valid tokens.
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError("mask must be a bool tensor [B, T]; use mask.bool().")
    for name, value in (("logp", logp), ("old_logp", old_logp)):
        if not isinstance(value, Tensor) or value.shape != mask.shape or value.dim() != 2:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"{name} must be [B, T] with the mask's shape {tuple(mask.shape)}; got {got}.")
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    diff = torch.where(mask, logp.detach() - old_logp.detach(), zero)
    count = mask.sum(dim=-1, keepdim=True).clamp_min(1).to(logp.dtype)
    seq = diff.sum(dim=-1, keepdim=True) / count
    return torch.where(mask, seq + logp - logp.detach(), zero)


def _truncated(log_w: Tensor, log_cap: float) -> Tensor:
    return torch.exp(torch.clamp(log_w, max=log_cap))


def _masked(log_w: Tensor, log_cap: float) -> Tensor:
    keep = log_w <= log_cap
    return torch.where(keep, torch.exp(torch.where(keep, log_w, torch.zeros_like(log_w))), torch.zeros_like(log_w))


IMPORTANCE_WEIGHT_MODES: dict[str, Callable[[Tensor, float], Tensor]] = {
    "tis": _truncated,
    "mis": _masked,
}


def importance_weights(
    trainer_logp: Tensor,
    sampler_logp: Tensor,
    mask: Tensor,
    *,
    mode: str = "tis",
    cap: float = 2.0,
) -> Tensor:
    """Per-token weights that correct for a sampler (e.g. vLLM) disagreeing with the trainer.

    With ``w = exp(trainer_logp - sampler_logp)``:

    * ``tis`` (truncated importance sampling): ``min(w, cap)``;
    * ``mis`` (masked importance sampling): ``w`` where ``w <= cap``, else 0 (the token
      is dropped from the gradient instead of being down-weighted).

    Args:
        trainer_logp: ``[B, T]`` log-probs the trainer computes for the sampled tokens.
        sampler_logp: ``[B, T]`` log-probs the sampler reported for them.
        mask: ``bool [B, T]`` valid tokens.
        mode: a key of ``IMPORTANCE_WEIGHT_MODES``.
        cap: the truncation / masking threshold, > 0.

    Returns:
        ``[B, T]`` detached weights; 0 at masked positions. Multiply the per-token policy
        loss by them.
    """
    weigh = lookup(IMPORTANCE_WEIGHT_MODES, mode, "mode")
    real_number("cap", cap, low=0, low_open=True)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError("mask must be a bool tensor [B, T]; use mask.bool().")
    for name, value in (("trainer_logp", trainer_logp), ("sampler_logp", sampler_logp)):
        if not isinstance(value, Tensor) or value.shape != mask.shape:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"{name} must have the mask's shape {tuple(mask.shape)}; got {got}.")
    zero = torch.zeros((), dtype=trainer_logp.dtype, device=trainer_logp.device)
    log_w = torch.where(mask, trainer_logp.detach() - sampler_logp.detach(), zero)
    return torch.where(mask, weigh(log_w, math.log(cap)), zero)


def effective_sample_size(log_weights: Tensor, mask: Tensor | None = None) -> Tensor:
    """Kish effective sample size ``(sum w)^2 / sum w^2`` from log-weights.

    Computed as ``exp(2 logsumexp(s) - logsumexp(2 s))`` over the valid entries with
    ``s = lw - max(lw)``, so it is exact to rounding for every finite log-weight (1e38
    included): only differences of log-weights matter. Unnormalised weights are fine
    (the ratio is scale-free).

    Args:
        log_weights: ``[...]`` log importance weights.
        mask: ``bool [...]`` with the same shape, or ``None`` for all entries.

    Returns:
        Scalar tensor in ``[1, n]`` for ``n`` valid entries; 0 when none is valid.
        Example: log-weights ``[log 2, 0, 0, log 0.5]`` give ``4.5^2 / 6.25 = 3.24``.
    """
    if not isinstance(log_weights, Tensor):
        raise TypeError(f"log_weights must be a torch.Tensor; got {type(log_weights).__name__}.")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError("mask must be None or a bool tensor; use mask.bool().")
        if mask.shape != log_weights.shape:
            raise ValueError(
                f"mask must have the shape of log_weights {tuple(log_weights.shape)}; got {tuple(mask.shape)}."
            )
    flat = log_weights.reshape(-1)
    if mask is not None:
        flat = torch.where(mask.reshape(-1), flat, torch.full_like(flat, -math.inf))
    top = flat.max() if flat.numel() else flat.new_full((), -math.inf)
    empty = torch.isneginf(top)
    # Shifting by the largest weight first keeps 2 * lw finite and the two log-sum-exps
    # near 0, where their difference keeps its digits (unshifted, 1e7 + log 2 rounds away).
    shifted = flat - torch.where(empty, torch.zeros_like(top), top)
    log_ess = 2.0 * torch.logsumexp(shifted, dim=0) - torch.logsumexp(2.0 * shifted, dim=0)
    return torch.where(empty, torch.zeros_like(top), torch.exp(log_ess))
