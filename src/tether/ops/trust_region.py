"""Trust regions to the sampling policy: which tokens' policy-gradient term is cut, per token.

Every kind returns a ``PolicyLoss`` whose gradient is that of the unclipped surrogate ``-r A``
(``r`` the importance ratio) on the tokens it keeps and exactly 0 on the ones it cuts:

* ``clip``: PPO's ratio clip (``clipped_surrogate``); a cut token keeps the clip bound's value.
* ``none``: no region; ``-r A`` everywhere (``dual_clip`` still bounds ``A < 0``).
* ``dppo_tv`` / ``dppo_kl``: DPPO's binary masks (Qi et al. 2026, "Rethinking the Trust Region in
  LLM Reinforcement Learning", arXiv 2602.04879), as verl's ``dppo_tv`` / ``dppo_kl`` policy
  losses and prime-rl's default loss define them. With ``p`` and ``q`` the current and the
  sampling policy's probability of the sampled token, a token is cut only when its update
  would push further out of the region: ``A > 0`` and ``p - q > high`` (TV) or
  ``KL_bin(q || p) > high`` with ``p > q`` (KL); ``A < 0`` and ``q - p > low`` (TV) or
  ``KL_bin(q || p) > low`` with ``p < q`` (KL). ``KL_bin`` is the KL between the Bernoulli
  distributions ``(q, 1 - q)`` and ``(p, 1 - p)``. A cut token's value is 0, as in both sources.

Departures: tokens with ``A = 0`` are never counted as cut (they carry no gradient); the ratio
is not truncated (verl's ``clip_ratio_c``): pass ``dual_clip`` to stop ``A < 0`` tokens whose
ratio passed ``c``, in every kind. Rationale and sources: docs/objectives.md.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Callable

import torch
from torch import Tensor

from tether.ops.checks import lookup, real_number
from tether.ops.policy_loss import PolicyLoss, _check_advantages, check_dual_clip, clipped_surrogate


def tv_shift(logp: Tensor, sampler_logp: Tensor) -> Tensor:
    """``[B, T]`` signed probability shift ``p - q = exp(logp) - exp(sampler_logp)`` of each sampled
    token, detached: its absolute value is the sampled token's share of the total variation."""
    return torch.exp(logp.detach()) - torch.exp(sampler_logp.detach())


def bernoulli_kl(logp: Tensor, sampler_logp: Tensor) -> Tensor:
    """``[B, T]`` ``KL_bin(q || p) = q log(q / p) + (1 - q) log((1 - q) / (1 - p))``, detached.

    ``1 - p`` is taken as ``-expm1(logp)`` so a probability near 1 keeps its digits; ``q = 1``
    gives ``0 log 0 = 0`` on the second term, ``p = 1 > q`` gives ``+inf`` (cut when it matters).
    Example: ``p = 0.5, q = 0.25``: ``0.25 log 0.5 + 0.75 log 1.5 = 0.130812``.
    """
    lp, lq = logp.detach(), sampler_logp.detach()
    rest_p, rest_q = -torch.expm1(lp), -torch.expm1(lq)
    return torch.exp(lq) * (lq - lp) + torch.special.xlogy(rest_q, rest_q) - torch.special.xlogy(rest_q, rest_p)


def _tv_cut(logp: Tensor, sampler_logp: Tensor, adv: Tensor, low: float, high: float) -> Tensor:
    shift = tv_shift(logp, sampler_logp)
    return ((adv > 0) & (shift > high)) | ((adv < 0) & (shift < -low))


def _kl_cut(logp: Tensor, sampler_logp: Tensor, adv: Tensor, low: float, high: float) -> Tensor:
    kl, up = bernoulli_kl(logp, sampler_logp), logp.detach() > sampler_logp.detach()
    down = logp.detach() < sampler_logp.detach()
    return ((adv > 0) & up & (kl > high)) | ((adv < 0) & down & (kl > low))


def _no_cut(logp: Tensor, sampler_logp: Tensor, adv: Tensor, low: float, high: float) -> Tensor:
    return torch.zeros(adv.shape, dtype=torch.bool, device=adv.device)


# kind -> which tokens it cuts, from (logp, sampler_logp, advantages, low, high); "clip" cuts on
# the ratio instead and goes through ``clipped_surrogate``.
TRUST_REGIONS: dict[str, Callable[[Tensor, Tensor, Tensor, float, float], Tensor] | None] = {
    "clip": None,
    "none": _no_cut,
    "dppo_tv": _tv_cut,
    "dppo_kl": _kl_cut,
}


def check_trust_region(kind: str, delta: float | tuple[float, float]) -> tuple[float, float]:
    """``(low, high)`` of a DPPO threshold ``delta`` (a number or a pair) after checking ``kind`` and it."""
    lookup(TRUST_REGIONS, kind, "trust_region")
    pair = delta if isinstance(delta, (tuple, list)) else (delta, delta)
    if len(pair) != 2 or not all(isinstance(v, Real) and not isinstance(v, bool) for v in pair):
        raise TypeError(f"trust_region_delta: expected a number or a (low, high) pair of numbers, got {delta!r}.")
    top, fix = (1.0, "A probability moves by at most 1, so the mask would never act.") if kind == "dppo_tv" else (None, "")
    return tuple(real_number(f"trust_region_delta {side}", v, low=0, low_open=True, high=top, high_open=True, fix=fix)
                 for side, v in zip(("low", "high"), pair))  # type: ignore[return-value]


def masked_surrogate(log_ratio: Tensor, advantages: Tensor, cut: Tensor) -> PolicyLoss:
    """``-r A`` per token where ``cut`` is False, 0 (value and gradient) where it is True.

    Args:
        log_ratio: ``[B, T]`` ``log pi - log pi_old``, in the graph.
        advantages: ``[B, T]`` or ``[B, 1]``, constants.
        cut: ``bool [B, T]`` tokens whose gradient the trust region cuts.
    """
    _check_advantages(log_ratio, advantages)
    adv = advantages.detach().expand_as(log_ratio).to(log_ratio.dtype)
    live = ~cut & (adv != 0)
    # Cut branches see a log-ratio of 0 so their exp stays finite in backward.
    ratio_live = torch.exp(torch.where(live, log_ratio, torch.zeros_like(log_ratio)))
    loss = torch.where(live, -ratio_live * adv, torch.zeros_like(adv))
    return PolicyLoss(loss=loss, clipped=cut & (adv != 0), ratio=torch.exp(log_ratio.detach()))


def trust_region_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    logp: Tensor,
    sampler_logp: Tensor,
    *,
    kind: str = "clip",
    clip_epsilon: float | tuple[float, float] = 0.2,
    delta: float | tuple[float, float] = 0.2,
    dual_clip: float | None = None,
) -> PolicyLoss:
    """The policy-gradient loss per token under the trust region ``kind`` (a key of ``TRUST_REGIONS``).

    Args:
        log_ratio: ``[B, T]`` ``log pi - log pi_old`` of the sampled tokens, in the graph.
        advantages: ``[B, T]`` or ``[B, 1]``, constants.
        logp, sampler_logp: ``[B, T]`` the current and the sampling policy's log-probs of the
            sampled tokens (read by the DPPO kinds, detached).
        clip_epsilon: the ``clip`` kind's ``eps`` or ``(low, high)``.
        delta: the DPPO kinds' threshold ``d`` or ``(low, high)``: a probability shift (``dppo_tv``,
            in (0, 1)) or a Bernoulli KL in nats (``dppo_kl``).
        dual_clip: ``c > 1``: ``A < 0`` tokens whose ratio passed ``c`` are cut too (every kind).

    Returns:
        ``PolicyLoss``; ``clipped`` marks the tokens the region (or the dual clip) cut.
    """
    low, high = check_trust_region(kind, delta)
    if kind == "clip":
        return clipped_surrogate(log_ratio, advantages, clip_epsilon=clip_epsilon, dual_clip=dual_clip)
    check_dual_clip(dual_clip)
    _check_advantages(log_ratio, advantages)
    adv = advantages.detach().expand_as(log_ratio).to(log_ratio.dtype)
    cut = TRUST_REGIONS[kind](logp, sampler_logp, adv, low, high)
    if dual_clip is not None:
        cut = cut | ((adv < 0) & (log_ratio.detach() > math.log(dual_clip)))
    return masked_surrogate(log_ratio, adv, cut)
