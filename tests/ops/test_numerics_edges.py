"""Numerics at the edges of tether.ops (issue 14, items 12-14): exact or a clear error.

Each test pins a value that was wrong before (a cancelled gradient, an overflowed sum, a
lost digit) against a float64 reference whose derivation is in the docstring.
"""

from __future__ import annotations

import math

import pytest
import torch

from tether.ops import kl_k3, kl_loss_term

F32, F64 = torch.float32, torch.float64
F32_MAX = torch.finfo(F32).max


def _log_ratios() -> torch.Tensor:
    """r = logp - ref_logp over [-100, 100], dense near 0 where cancellation hides."""
    wide = torch.linspace(-100.0, 100.0, 401, dtype=F64)
    near = torch.tensor([1e-7, 1e-5, 1e-3, 0.1, 0.49, 0.5, 0.51], dtype=F64)
    return torch.cat([wide, near, -near])


@pytest.mark.parametrize("offset", [0.0, -3.0, 2.5])
def test_importance_k3_exact_in_float32_over_log_ratios_of_100(offset):
    """kl_loss_term(k3) = w * k3 with w = exp(logp - old), d = ref - logp = -r.

    Value: w (e^d - 1 - d), in float64 from math.expm1 (its own rounding ~1e-16).
    Gradient w.r.t. logp: d/dlogp [w (e^d - 1 - d)] = w (e^d - 1 - d) + w (1 - e^d)
    = -w d = w r (``old`` is a constant). Before the fix float32 autograd gave 0 from
    r ~ -22 and NaN once e^d overflowed; now both match float64 to a few ulps. Where the
    exact value exceeds float32 (r < ~-88.7 on-policy) the value is inf, never NaN.
    """
    r = _log_ratios()
    old = r + offset  # logp = r, ref = 0, old = logp + offset: w = exp(-offset)
    w = math.exp(-offset)
    value64 = torch.tensor([w * (math.expm1(-x) + x) for x in r.tolist()], dtype=F64)
    grad64 = w * r
    logp = r.to(F32).requires_grad_(True)
    term = kl_loss_term(logp, torch.zeros_like(logp), old_logp=old.to(F32))
    (grad,) = torch.autograd.grad(term.sum(), logp)
    torch.testing.assert_close(grad.double(), grad64, rtol=2e-6, atol=0)
    fits, over = value64 < F32_MAX * 0.999, value64 > F32_MAX * 1.001
    torch.testing.assert_close(term.double()[fits], value64[fits], rtol=2e-6, atol=0)
    assert torch.isposinf(term[over]).all() and (r[~fits] < -85).all()


def test_importance_k3_gradient_matches_naive_autograd_where_naive_is_exact():
    """For |r| <= 5 in float64 the autograd of w*(expm1(d) - d) loses < 1e-12: the fast
    backward must agree with it, which ties the closed form w r to autograd itself."""
    logp = torch.linspace(-5, 5, 41, dtype=F64).requires_grad_(True)
    ref = torch.linspace(1, -2, 41, dtype=F64)
    old = logp.detach() - 0.7
    naive = torch.exp(logp - old) * (torch.expm1(ref - logp) - (ref - logp))
    expected = torch.autograd.grad(naive.sum(), logp)[0]
    actual = torch.autograd.grad(kl_loss_term(logp, ref, old_logp=old).sum(), logp)[0]
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def test_importance_k3_second_derivative():
    """d^2/dlogp^2 [w k3] = d/dlogp [w r] = w r + w = w (r + 1): double backward works."""
    logp = torch.tensor([-3.0, 0.0, 40.0], dtype=F64, requires_grad=True)
    old = torch.tensor([-3.0, 1.0, 40.0], dtype=F64)
    (grad,) = torch.autograd.grad(kl_loss_term(logp, torch.zeros(3, dtype=F64), old_logp=old).sum(), logp, create_graph=True)
    (second,) = torch.autograd.grad(grad.sum(), logp)
    w = torch.exp(logp.detach() - old)
    torch.testing.assert_close(second, w * (logp.detach() + 1), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_k3_relative_error_a_few_ulps_near_zero(dtype):
    """k3(d) = e^d - 1 - d = d^2/2 + d^3/6 + d^4/24 + ... (float64 series to d^19 is exact
    to 1e-20 relative for |d| <= 0.6). expm1(d) - d lost log2(2/|d|) bits there: 1e-3
    relative error in float32 at |d| = 1e-4."""
    d = torch.tensor([1e-6, -1e-6, 1e-4, -1e-4, 0.01, -0.3, 0.45, -0.49, 0.55, -0.6], dtype=F64)
    series = sum(d**n / math.factorial(n) for n in range(2, 20))
    value = kl_k3(torch.zeros_like(d).to(dtype), d.to(dtype)).double()
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(value, series, rtol=4 * ulp, atol=0)
