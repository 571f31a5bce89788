"""Sample-based KL estimators and the differentiable KL term of an RL loss.

Notation: ``r = logp - ref_logp = log pi(x) - log pi_ref(x)`` for a sampled token ``x``.
Every estimator below is a function of ``r`` alone, evaluated per token, and is meant to
estimate the reverse divergence ``KL(pi || pi_ref) = E_{x~pi}[r]``.

How it departs from the usual recipe: the GRPO paper (Shao et al. 2024) and TorchRL put
the raw k3 estimator into the loss. Its value is an unbiased estimate of ``KL(pi||pi_ref)``
but its expected gradient is that of the forward divergence ``KL(pi_ref||pi)``.
``kl_loss_term`` defaults to an importance-weighted form whose expected gradient is the
gradient of the reverse divergence, on-policy and off-policy; the raw form stays available
as ``correction=None``. Using k1 (or abs) as a loss is refused: see ``kl_loss_term``.

Sequences: summing a per-token loss term over the tokens of a sequence gives, in
expectation, the gradient of the per-token divergences with every context held fixed. The
gradient of the sequence-level KL also has a term for how earlier tokens change the
contexts of later ones. That term is captured by putting k1 into the reward and using the
return (reward-to-go), or by applying ``kl_loss_term`` to sequence-level log-probs.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from tether.ops.checks import lookup

KLEstimator = Callable[[Tensor, Tensor], Tensor]


# Taylor coefficients 1/(k+2)!, k = 0..13, of (e^d - 1 - d) / d^2; the first omitted term
# is below 1e-19 relative for |d| < 1/2, under float64's rounding.
_SERIES = tuple(1.0 / math.factorial(k + 2) for k in range(14))


def _expm1_minus_identity(d: Tensor) -> Tensor:
    """``e^d - 1 - d`` element-wise, accurate to a few ulps for every ``d``.

    ``expm1(d) - d`` alone loses about ``log2(2/|d|)`` bits near 0 (the rounding error of
    ``expm1(d) ~ d`` against a result ``~ d^2/2``), so small ``|d|`` uses the series.
    """
    small = d.abs() < 0.5
    x = torch.where(small, d, torch.zeros_like(d))
    series = torch.full_like(x, _SERIES[-1])
    for coefficient in reversed(_SERIES[:-1]):
        series = series * x + coefficient
    return torch.where(small, x * x * series, torch.expm1(d) - d)


def _check_pair(logp: Tensor, ref_logp: Tensor, names: tuple[str, str]) -> None:
    if not isinstance(logp, Tensor) or not isinstance(ref_logp, Tensor):
        raise TypeError(
            f"{names[0]} and {names[1]} must be torch.Tensor; got "
            f"{type(logp).__name__} and {type(ref_logp).__name__}. Convert them with torch.as_tensor."
        )
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"{names[1]} must have the shape of {names[0]} {tuple(logp.shape)}; got "
            f"{tuple(ref_logp.shape)}. Align both to the same tokens (no broadcasting here)."
        )


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log pi - log pi_ref, per token.

    Args:
        logp: ``[...]`` log pi of the sampled tokens.
        ref_logp: ``[...]`` log pi_ref of the same tokens.

    Returns:
        ``[...]`` estimate, same shape.

    Bias: none; ``E_pi[k1] = KL(pi||pi_ref)``. A single sample can be negative and the
    variance is the largest of the three classic estimators.

    Gradient as a reward penalty (k1 treated as a constant reward, score-function
    gradient ``E_pi[k1 * grad log pi]``): exactly ``grad KL(pi||pi_ref)``. This is the
    right place for k1.

    Gradient as a loss: ``grad k1 = grad log pi`` and ``E_pi[grad log pi] = 0``, so the
    expected gradient is zero; ``kl_loss_term`` refuses it.
    """
    _check_pair(logp, ref_logp, ("logp", "ref_logp"))
    return logp - ref_logp


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = (log pi - log pi_ref)^2 / 2, per token.

    Args:
        logp: ``[...]`` log pi of the sampled tokens.
        ref_logp: ``[...]`` log pi_ref of the same tokens.

    Returns:
        ``[...]`` estimate, same shape, never negative.

    Bias: ``E_pi[k2]`` agrees with ``KL(pi||pi_ref)`` to second order in ``r`` and differs
    at third order (it is an f-divergence with ``f(u) = (log u)^2 / 2``); low variance.

    Gradient as a reward penalty: ``E_pi[k2 * grad log pi]`` is not ``grad KL``.

    Gradient as a loss: ``grad k2 = r * grad log pi`` and ``E_pi[r * grad log pi] =
    grad KL(pi||pi_ref)``, so on-policy the expected gradient is exact. Off-policy
    (samples from pi_old) it needs the detached weight ``pi/pi_old``.
    """
    _check_pair(logp, ref_logp, ("logp", "ref_logp"))
    return 0.5 * (logp - ref_logp).square()


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = pi_ref/pi - 1 - log(pi_ref/pi), per token (Schulman's estimator).

    Computed as ``e^d - 1 - d`` with ``d = ref_logp - logp``: a Taylor series for
    ``|d| < 1/2`` and ``expm1(d) - d`` beyond, so the relative error stays within a few
    ulps everywhere, near ``d = 0`` included.

    Args:
        logp: ``[...]`` log pi of the sampled tokens.
        ref_logp: ``[...]`` log pi_ref of the same tokens.

    Returns:
        ``[...]`` estimate, same shape, never negative.

    Bias: none; ``E_pi[pi_ref/pi] = 1`` so ``E_pi[k3] = KL(pi||pi_ref)``. Lower variance
    than k1 when pi is close to pi_ref.

    Gradient as a reward penalty: ``E_pi[k3 * grad log pi] = grad KL(pi||pi_ref) -
    grad KL(pi_ref||pi)``, not ``grad KL``.

    Gradient as a loss: ``grad k3 = (1 - pi_ref/pi) * grad log pi``, whose expectation
    under pi is ``-sum_x pi_ref(x) grad log pi(x) = grad KL(pi_ref||pi)``: the forward
    divergence. Weighting by ``w = pi/pi_old`` kept in the graph gives
    ``grad E_pi[k3] = grad KL(pi||pi_ref)``.
    """
    _check_pair(logp, ref_logp, ("logp", "ref_logp"))
    return _expm1_minus_identity(ref_logp - logp)


def kl_abs(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """abs = |log pi - log pi_ref|, per token.

    Args:
        logp: ``[...]`` log pi of the sampled tokens.
        ref_logp: ``[...]`` log pi_ref of the same tokens.

    Returns:
        ``[...]`` estimate, same shape, never negative.

    Bias: upward, ``E_pi|r| >= |E_pi r| = KL(pi||pi_ref)``; a diagnostic of distance
    rather than an estimate of KL.

    Gradient as a reward penalty: ``E_pi[|r| * grad log pi]`` is not ``grad KL``.

    Gradient as a loss: ``E_pi[sign(r) * grad log pi]``, not ``grad KL``;
    ``kl_loss_term`` refuses it.
    """
    _check_pair(logp, ref_logp, ("logp", "ref_logp"))
    return (logp - ref_logp).abs()


KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "abs": kl_abs,
}


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL estimate by name: ``KL_ESTIMATORS[estimator](logp, ref_logp)``.

    Args:
        logp: ``[...]`` log pi of the sampled tokens.
        ref_logp: ``[...]`` log pi_ref, same shape.
        estimator: one of ``KL_ESTIMATORS`` (``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``).

    Returns:
        ``[...]`` per-token estimate.
    """
    return lookup(KL_ESTIMATORS, estimator, "estimator")(logp, ref_logp)


_REFUSED_AS_LOSS = {
    "k1": (
        "the expected gradient of k1 as a loss is zero: grad k1 = grad log pi and "
        "E_pi[grad log pi] = 0. k1 belongs in the reward as a penalty, where its "
        "score-function gradient is grad KL(pi||pi_ref)"
    ),
    "abs": (
        "the expected gradient of abs as a loss is E_pi[sign(r) grad log pi], which is not "
        "the gradient of any KL. Use it for monitoring only"
    ),
}


class _WeightedK3(torch.autograd.Function):
    """``w * k3`` with ``w = exp(logp - old)``, differentiated w.r.t. ``logp`` only.

    The weight stays in the graph, so ``grad(w k3)`` integrates to ``grad E_pi[k3] = grad
    KL``. Autograd would form that gradient as ``w k3 + w (1 - e^d)``: two terms of size
    ``e^d`` that cancel, leaving 0 in float32 from ``d ~ 22`` and ``inf - inf = NaN`` once
    ``e^d`` overflows. They cancel exactly, to ``w * (logp - ref_logp)`` (the gradient of
    ``sg(w) k2``), which backward returns directly; it is itself differentiable, so
    double backward works.
    """

    @staticmethod
    def forward(ctx, logp: Tensor, ref_logp: Tensor, old_logp: Tensor) -> Tensor:
        ctx.save_for_backward(logp, ref_logp, old_logp)
        # In float64 a small w times an e^d past float32's range is still exact; the
        # element-wise [B, T] work is negligible next to the logits that produced logp.
        logp64, ref64, old64 = (t.to(torch.float64) for t in (logp, ref_logp, old_logp))
        value = torch.exp(logp64 - old64) * _expm1_minus_identity(ref64 - logp64)
        return value.to(torch.promote_types(logp.dtype, ref_logp.dtype))

    @staticmethod
    def backward(ctx, grad: Tensor):
        logp, ref_logp, old_logp = ctx.saved_tensors
        return grad * torch.exp(logp - old_logp) * (logp - ref_logp), None, None


def _importance_k3(logp: Tensor, ref_logp: Tensor, old_logp: Tensor) -> Tensor:
    return _WeightedK3.apply(logp, ref_logp, old_logp)


def _importance_k2(logp: Tensor, ref_logp: Tensor, old_logp: Tensor) -> Tensor:
    # The weight is a constant: only r * grad log pi is wanted, reweighted to pi.
    return torch.exp(logp - old_logp).detach() * kl_k2(logp, ref_logp)


_IMPORTANCE_FORMS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "k2": _importance_k2,
    "k3": _importance_k3,
}


def _importance(estimator: str, logp: Tensor, ref_logp: Tensor, old_logp: Tensor | None) -> Tensor:
    old = logp.detach() if old_logp is None else old_logp.detach()
    return _IMPORTANCE_FORMS[estimator](logp, ref_logp, old)


def _raw(estimator: str, logp: Tensor, ref_logp: Tensor, old_logp: Tensor | None) -> Tensor:
    if old_logp is not None:
        raise ValueError(
            "old_logp is only used by correction='importance'; with correction=None the raw "
            f"{estimator} term ignores the sampling policy. Pass old_logp=None, or use "
            "correction='importance' for samples drawn from pi_old."
        )
    return KL_ESTIMATORS[estimator](logp, ref_logp)


KL_CORRECTIONS: dict[str | None, Callable[[str, Tensor, Tensor, Tensor | None], Tensor]] = {
    "importance": _importance,
    None: _raw,
}


def check_kl_loss_options(estimator: str, correction: str | None, *, names: tuple[str, str] = ("estimator", "correction")
                          ) -> Callable[[str, Tensor, Tensor, Tensor | None], Tensor]:
    """The correction's function after checking ``kl_loss_term``'s options; ``names`` are the caller's
    arguments for them, which the errors name."""
    if estimator in _REFUSED_AS_LOSS:
        raise ValueError(f"{names[0]}={estimator!r} cannot be used as a KL loss: {_REFUSED_AS_LOSS[estimator]}.")
    lookup(_IMPORTANCE_FORMS, estimator, names[0])
    return lookup(KL_CORRECTIONS, correction, names[1])


def kl_loss_term(
    logp: Tensor,
    ref_logp: Tensor,
    *,
    estimator: str = "k3",
    old_logp: Tensor | None = None,
    correction: str | None = "importance",
) -> Tensor:
    """Per-token differentiable KL term to add to a loss (reduce it with ``aggregate``).

    Args:
        logp: ``[B, T]`` log pi of the sampled tokens, in the graph.
        ref_logp: ``[B, T]`` log pi_ref of the same tokens (treated as a constant).
        estimator: ``"k3"`` or ``"k2"``. ``"k1"`` and ``"abs"`` raise ``ValueError``.
        old_logp: ``[B, T]`` log pi_old of the policy that drew the samples; ``None``
            means on-policy (``old = logp.detach()``).
        correction: a key of ``KL_CORRECTIONS``:

            * ``"importance"`` (default): samples from pi_old, ``w = exp(logp - old_logp)``.
              k3 gives ``w * k3`` with ``w`` in the graph; k2 gives ``sg(w) * k2``. Both
              have expected gradient ``grad KL(pi||pi_ref)`` at the current pi, and on
              policy both have the value of the raw estimator (``w = 1``).
            * ``None``: the raw estimator as a loss. Raw k3 is the GRPO paper / TorchRL
              term: its expected gradient is ``grad KL(pi_ref||pi)``, the gradient of the
              forward KL, not the reverse KL it estimates. Raw k2 is correct only
              on-policy. ``old_logp`` must be ``None`` here.

    Returns:
        ``[B, T]`` per-token term (any shape works; the output has the input's shape).

    Range: the gradient w.r.t. ``logp`` is ``w * (logp - ref_logp)`` for both estimators,
    computed without cancellation, so it is exact to rounding in float32 for log-ratios
    of +-100 (and wherever ``w * r`` is representable). The value of k3 is ``w (e^d - 1 -
    d)`` with ``d = ref_logp - logp``, formed in float64 and rounded once to the input
    dtype: it is ``inf`` only where that number exceeds the dtype (``d > ~88.7`` in float32
    on-policy), never NaN.

    Per-token terms summed over a sequence differentiate each token's KL at a fixed
    context; for the sequence-level KL gradient see the module docstring.
    """
    apply = check_kl_loss_options(estimator, correction)
    _check_pair(logp, ref_logp, ("logp", "ref_logp"))
    if old_logp is not None:
        _check_pair(logp, old_logp, ("logp", "old_logp"))
    return apply(estimator, logp, ref_logp.detach(), old_logp)
