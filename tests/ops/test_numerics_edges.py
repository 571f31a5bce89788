"""Numerics at the edges of tether.ops (issue 14, items 12-14): exact or a clear error.

Each test pins a value that was wrong before (a cancelled gradient, an overflowed sum, a
lost digit) against a float64 reference whose derivation is in the docstring.
"""

from __future__ import annotations

import math

import pytest
import torch

from tether.ops import aggregate, effective_sample_size, group_advantages, kl_k3, kl_loss_term

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


# ---------------------------------------------------------------- item 13: large magnitudes


@pytest.mark.parametrize("big", [1e7, 1e20, 1e38, -3e38])
def test_effective_sample_size_depends_only_on_log_weight_differences(big):
    """ESS is scale-free: lw = [b, b] gives equal weights, (2w)^2 / (2 w^2) = 2 (before:
    7.39 at 1e7, NaN at 1e38). lw = [b, b - 1.1] with the float64 difference
    delta = lw_1 - lw_0 (exact, Sterbenz) gives (1 + e^delta)^2 / (1 + e^(2 delta));
    delta = -1.1 for 1e7, and 0 (so ESS 2) where b - 1.1 rounds back to b."""
    two = effective_sample_size(torch.tensor([big, big], dtype=F32))
    assert two.item() == 2.0
    lw = torch.tensor([big, big - 1.1], dtype=F64)
    delta = (lw[1] - lw[0]).item()
    expected = (1 + math.exp(delta)) ** 2 / (1 + math.exp(2 * delta))
    assert effective_sample_size(lw).item() == pytest.approx(expected, rel=1e-14)


def test_effective_sample_size_of_opposite_extremes_is_one():
    """lw = [-3e38, 3e38]: the second weight is e^(6e38) times the first: ESS = 1 exactly
    (the difference overflows to -inf, a weight of exactly 0)."""
    assert effective_sample_size(torch.tensor([-3e38, 3e38])).item() == 1.0


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("big", [3e38, 1e-40])
def test_group_advantages_exact_near_the_dtype_limits(mode, big):
    """Rewards [b, 0, b, 0] (one group): mean b/2, centred +-b/2, Bessel std b/sqrt(3).
    grpo: (b/2) / (b/sqrt(3) + eps) -> sqrt(3)/2 for b = 3e38; for b = 1e-40 the eps
    dominates: 5e-41 / (5.77e-41 + 1e-6) = 5e-35. dr_grpo: +-b/2. rloo: 4/3 * b/2 = 2b/3.
    Before: the sum b + b overflowed to inf and every advantage was NaN."""
    rewards = torch.tensor([big, 0.0, big, 0.0], dtype=F32)
    b = rewards[0].double()  # 1e-40 is subnormal in float32: use the stored value
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=F64)
    expected = {
        "grpo": (b / 2) / (b / math.sqrt(3) + 1e-6),
        "dr_grpo": b / 2,
        "rloo": 2 * b / 3,
    }[mode] * sign
    result = group_advantages(rewards, mode=mode)
    # Subnormal results (dr_grpo, rloo at 1e-40) are quantised in steps of 2^-149.
    torch.testing.assert_close(result.double(), expected, rtol=4e-7, atol=2.0**-148)


@pytest.mark.parametrize("mode", ["dr_grpo", "rloo"])
def test_group_advantages_that_do_not_fit_raise(mode):
    """[3e38, -3.4e38, -3.4e38]: mean -1.27e38, centred 4.27e38 > float32 max (3.40e38);
    rloo's r_0 - mean(others) = 6.4e38. Neither fits: ValueError naming mode and dtype."""
    rewards = torch.tensor([3e38, -3.4e38, -3.4e38])
    with pytest.raises(ValueError, match=rf"mode='{mode}'.*does not fit in torch.float32.*float64"):
        group_advantages(rewards, mode=mode)
    exact = group_advantages(rewards.double(), mode=mode)
    assert torch.isfinite(exact).all()


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_float64_rewards_whose_spread_overflows_raise(mode):
    """[1e200, 0, 1e200, 0] float64: centred +-5e199, squared 2.5e399 > float64 max (1.8e308), so
    the group's spread is inf and grpo would read 5e199 / inf = 0 for every sample: a silent zero.
    Every mode refuses (the spread is checked whichever mode reads it); 1e150 still fits:
    grpo sqrt(3)/2, dr_grpo 5e149, rloo 2e150 / 3."""
    with pytest.raises(ValueError, match=rf"mode='{mode}'.*does not fit in torch.float64.*rescale the rewards\.$"):
        group_advantages(torch.tensor([1e200, 0.0, 1e200, 0.0], dtype=F64), mode=mode)
    b = 1e150
    expected = {"grpo": (b / 2) / (b / math.sqrt(3) + 1e-6), "dr_grpo": b / 2, "rloo": 2 * b / 3}[mode]
    got = group_advantages(torch.tensor([b, 0.0, b, 0.0], dtype=F64), mode=mode)
    torch.testing.assert_close(got, expected * torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=F64), rtol=1e-15, atol=0)


def test_group_advantages_refuse_non_finite_rewards():
    with pytest.raises(ValueError, match="rewards must be finite"):
        group_advantages(torch.tensor([1.0, float("nan"), 0.0]))
    with pytest.raises(ValueError, match="rewards must be finite"):
        group_advantages(torch.tensor([[1.0, float("inf")]]), mode="dr_grpo")


def test_aggregate_tensor_denominator_not_positive():
    """A tensor count is not read back: 0 with nothing to add gives 0 (the empty batch), a
    count <= 0 with valid tokens gives NaN (before: treated as 1, a plausible wrong loss);
    a number <= 0 and a tensor that is not one real element raise."""
    values = torch.tensor([[2.0, 4.0]])
    mask = torch.tensor([[True, True]])
    assert aggregate(values, ~mask, denominator=torch.tensor(0)).item() == 0.0
    assert math.isnan(aggregate(values, mask, denominator=torch.tensor(0)).item())
    assert math.isnan(aggregate(values, mask, denominator=torch.tensor(-3)).item())
    assert math.isnan(aggregate(values, ~mask, denominator=torch.tensor(-3)).item())
    assert aggregate(values, mask, denominator=torch.tensor(3)).item() == 2.0
    with pytest.raises(ValueError, match=r"denominator: expected a finite number > 0, got 0"):
        aggregate(values, mask, denominator=0)
    with pytest.raises(TypeError, match=r"denominator: expected a one-element real tensor.*shape \(2,\)"):
        aggregate(values, mask, denominator=torch.tensor([1, 2]))
    with pytest.raises(TypeError, match=r"one-element real tensor.*torch.bool"):
        aggregate(values, mask, denominator=torch.tensor(True))


def test_aggregate_mask_on_another_device_is_named():
    values = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"mask is on meta but values is on cpu; move mask with \.to\(values\.device\)"):
        aggregate(values, torch.ones(2, 3, dtype=torch.bool, device="meta"))
