"""Clipped surrogate, GSPO ratio, sampler-mismatch weights and the effective sample size."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tether.ops import (
    IMPORTANCE_WEIGHT_MODES,
    aggregate,
    clipped_surrogate,
    effective_sample_size,
    gspo_log_ratio,
    importance_weights,
)

F64 = torch.float64


def _t(values, **kwargs):
    return torch.tensor(values, dtype=F64, **kwargs)


def _close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


def _naive_surrogate(log_ratio, adv, low, high, dual):
    ratio = log_ratio.exp()
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)
    if dual is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual * adv), loss)
    return loss


# ---------------------------------------------------------------- clipped surrogate


def test_hand_derived_cases():
    """eps = 0.2, columns (r, A):
    (1.5, 2): A > 0, r above 1.2 -> -1.2 * 2 = -2.4, clipped, no gradient.
    (1.1, 2): inside -> -2.2, gradient d(-r A)/d log r = -r A = -2.2.
    (0.5, 2): A > 0, r below 0.8: min picks r A -> -1.0, not clipped, gradient -1.0.
    (0.5, -1): A < 0, r below 0.8 -> -0.8 * -1 = 0.8, clipped.
    (1.5, -1): A < 0, r above 1.2: min picks r A -> 1.5, not clipped, gradient 1.5.
    (1.5, 0): 0, gradient 0."""
    ratios = [1.5, 1.1, 0.5, 0.5, 1.5, 1.5]
    log_ratio = _t([[math.log(r) for r in ratios]], requires_grad=True)
    adv = _t([[2.0, 2.0, 2.0, -1.0, -1.0, 0.0]])
    out = clipped_surrogate(log_ratio, adv)
    _close(out.loss, [[-2.4, -2.2, -1.0, 0.8, 1.5, 0.0]])
    assert out.clipped.tolist() == [[True, False, False, True, False, False]]
    _close(out.ratio, [ratios])
    (grad,) = torch.autograd.grad(out.loss.sum(), log_ratio)
    _close(grad, [[0.0, -2.2, -1.0, 0.0, 1.5, 0.0]])


def test_clip_higher_and_dual_clip():
    """(low, high) = (0.2, 0.28): r = 1.25 with A = 1 is inside (loss -1.25), r = 1.3 is
    clipped at 1.28. dual_clip 3 with A = -2: r = 5 is capped at 3 * 2 = 6 (clipped, no
    gradient), r = 2 gives 4 with gradient 4."""
    log_ratio = _t([[math.log(1.25), math.log(1.3), math.log(5.0), math.log(2.0)]], requires_grad=True)
    adv = _t([[1.0, 1.0, -2.0, -2.0]])
    out = clipped_surrogate(log_ratio, adv, clip_epsilon=(0.2, 0.28), dual_clip=3.0)
    _close(out.loss, [[-1.25, -1.28, 6.0, 4.0]])
    assert out.clipped.tolist() == [[False, True, True, False]]
    (grad,) = torch.autograd.grad(out.loss.sum(), log_ratio)
    _close(grad, [[-1.25, 0.0, 0.0, 4.0]])


def test_zero_low_clip_cuts_every_ratio_below_one_for_negative_advantages():
    """low = 0: clip(r, 1, 1.2); A = -1, r = 0.9 -> -min(-0.9, -1) = 1, clipped."""
    out = clipped_surrogate(_t([[math.log(0.9)]]), _t([[-1.0]]), clip_epsilon=(0.0, 0.2))
    _close(out.loss, [[1.0]])
    assert out.clipped.tolist() == [[True]]


# Advantages are 0 or at least 1e-3 in size: a subnormal one (5e-324) times a ratio below one
# underflows to a zero gradient that no clip caused, and the clip mask is read off the gradient.
_ADVANTAGE = st.floats(-2, 2).filter(lambda a: a == 0 or abs(a) >= 1e-3)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-3, 3), _ADVANTAGE), min_size=1, max_size=8),
    st.sampled_from([0.2, (0.1, 0.3), (0.0, 0.5)]),
    st.sampled_from([None, 2.0, 3.0]),
)
def test_matches_naive_formula_loss_and_gradient(pairs, clip, dual):
    low, high = clip if isinstance(clip, tuple) else (clip, clip)
    bounds = [math.log1p(-low), math.log1p(high)] + ([math.log(dual)] if dual else [])
    assume(all(abs(lr - b) > 1e-6 for lr, _ in pairs for b in bounds))
    log_ratio = _t([[lr for lr, _ in pairs]], requires_grad=True)
    adv = _t([[a for _, a in pairs]])
    out = clipped_surrogate(log_ratio, adv, clip_epsilon=clip, dual_clip=dual)
    naive = _naive_surrogate(log_ratio, adv, low, high, dual)
    _close(out.loss, naive.detach())
    (grad,) = torch.autograd.grad(out.loss.sum(), log_ratio)
    (naive_grad,) = torch.autograd.grad(naive.sum(), log_ratio)
    _close(grad, naive_grad)
    cut = (grad == 0) & (adv != 0)
    assert torch.equal(out.clipped, cut)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_log_ratios(dtype):
    """log r = +-100. Finite in both dtypes: clipped tokens (constant bound), A > 0 with tiny
    r, A = 0, and A < 0 capped by the dual clip. A < 0 with r = e^100 and no dual clip is
    the genuinely unbounded case: finite in float64 (e^100), beyond float32."""
    log_ratio = torch.tensor([[100.0, -100.0, -100.0, 100.0, 100.0]], dtype=dtype, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0, 0.0, -1.0]], dtype=dtype)
    out = clipped_surrogate(log_ratio, adv, dual_clip=3.0)
    (grad,) = torch.autograd.grad(out.loss.sum(), log_ratio)
    assert torch.isfinite(out.loss).all() and torch.isfinite(grad).all()
    expected = [-1.2, 0.8, -math.exp(-100), 0.0, 3.0]
    torch.testing.assert_close(out.loss, torch.tensor([expected], dtype=dtype), rtol=1e-6, atol=0)
    assert out.clipped.tolist() == [[True, True, False, False, True]]

    if dtype == F64:
        lr = _t([[100.0]], requires_grad=True)
        unbounded = clipped_surrogate(lr, _t([[-1.0]]))
        (g,) = torch.autograd.grad(unbounded.loss.sum(), lr)
        assert unbounded.loss.item() == pytest.approx(math.exp(100), rel=1e-12)
        assert g.item() == pytest.approx(math.exp(100), rel=1e-12)


def test_sequence_advantages_broadcast():
    gen = torch.Generator().manual_seed(0)
    log_ratio = 0.3 * torch.randn(3, 5, generator=gen, dtype=F64)
    adv = torch.randn(3, 1, generator=gen, dtype=F64)
    a = clipped_surrogate(log_ratio, adv)
    b = clipped_surrogate(log_ratio, adv.expand(3, 5))
    assert torch.equal(a.loss, b.loss) and torch.equal(a.clipped, b.clipped)


def test_surrogate_errors():
    lr, adv = torch.zeros(2, 3), torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"clip_epsilon low: expected a finite number in \[0, 1\)"):
        clipped_surrogate(lr, adv, clip_epsilon=1.0)
    with pytest.raises(ValueError, match=r"clip_epsilon low"):
        clipped_surrogate(lr, adv, clip_epsilon=(-0.1, 0.2))
    with pytest.raises(ValueError, match=r"clip_epsilon high: expected a finite number >= 0"):
        clipped_surrogate(lr, adv, clip_epsilon=(0.2, -0.1))
    with pytest.raises(TypeError, match=r"clip_epsilon: expected a number or a \(low, high\) pair"):
        clipped_surrogate(lr, adv, clip_epsilon=(0.1, 0.2, 0.3))
    with pytest.raises(TypeError, match=r"clip_epsilon"):
        clipped_surrogate(lr, adv, clip_epsilon="0.2")
    with pytest.raises(ValueError, match=r"dual_clip: expected a finite number > 1, got 1.0"):
        clipped_surrogate(lr, adv, dual_clip=1.0)
    with pytest.raises(TypeError, match=r"dual_clip: expected a finite number > 1, got .* of type"):
        clipped_surrogate(lr, adv, dual_clip="3")
    with pytest.raises(ValueError, match=r"advantages must be \[B, T\] = \(2, 3\) or \[B, 1\] = \(2, 1\); got \(2,\)"):
        clipped_surrogate(lr, adv[:, 0])
    with pytest.raises(ValueError, match=r"log_ratio must be a \[B, T\] tensor; got \(3,\)"):
        clipped_surrogate(lr[0], adv[0])


# ---------------------------------------------------------------- GSPO


def test_gspo_values_and_token_gradients():
    """Row 0: log-ratios [0.2, 0.4, (pad)] -> s = 0.3 on both valid tokens; row 1 empty -> 0.
    d(sum_t c_t * value_t)/d logp_t = c_t on valid tokens, 0 on padding (each token's own
    score); old_logp gets no gradient."""
    logp = _t([[0.2, 0.4, 9.0], [1.0, 2.0, 3.0]], requires_grad=True)
    old = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    mask = torch.tensor([[True, True, False], [False, False, False]])
    value = gspo_log_ratio(logp, old, mask)
    _close(value, [[0.3, 0.3, 0.0], [0.0, 0.0, 0.0]])
    weights = _t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    (value * weights).sum().backward()
    _close(logp.grad, [[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    assert old.grad is None


def test_gspo_token_form_equals_sequence_form_gradient():
    """With one advantage per sequence and seq-mean-token-mean, the GSPO-token loss has the
    gradient of the sequence-level loss -exp(s) A with s the differentiable masked mean."""
    gen = torch.Generator().manual_seed(2)
    logp = (0.1 * torch.randn(3, 6, generator=gen, dtype=F64)).requires_grad_()
    old = 0.1 * torch.randn(3, 6, generator=gen, dtype=F64)
    mask = torch.arange(6) < torch.tensor([[6], [2], [4]])
    adv = torch.randn(3, 1, generator=gen, dtype=F64)
    token = clipped_surrogate(gspo_log_ratio(logp, old, mask), adv, clip_epsilon=(0.9, 10.0))
    (g_token,) = torch.autograd.grad(aggregate(token.loss, mask, "seq-mean-token-mean"), logp)
    s = ((logp - old) * mask).sum(-1) / mask.sum(-1)
    (g_seq,) = torch.autograd.grad((-s.exp() * adv[:, 0]).mean(), logp)
    _close(g_token, g_seq)


def test_gspo_unchanged_by_extra_padding():
    gen = torch.Generator().manual_seed(4)
    logp, old = torch.randn(2, 4, generator=gen, dtype=F64), torch.randn(2, 4, generator=gen, dtype=F64)
    mask = torch.tensor([[True, True, True, False], [False, True, True, True]])
    base = gspo_log_ratio(logp, old, mask)
    junk = torch.full((2, 3), float("nan"), dtype=F64)
    wide = gspo_log_ratio(torch.cat([logp, junk], 1), torch.cat([old, junk], 1), torch.cat([mask, junk.isinf()], 1))
    _close(wide[:, :4], base)
    assert torch.equal(wide[:, 4:], torch.zeros(2, 3, dtype=F64))


def test_gspo_errors():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"mask must be a bool tensor"):
        gspo_log_ratio(torch.zeros(2, 3), torch.zeros(2, 3), mask.float())
    with pytest.raises(ValueError, match=r"old_logp must be \[B, T\] with the mask's shape \(2, 3\); got \(2, 4\)"):
        gspo_log_ratio(torch.zeros(2, 3), torch.zeros(2, 4), mask)


# ---------------------------------------------------------------- importance weights, ESS


def test_tis_and_mis_hand_values():
    """cap 2, w = [3, 1.5, 0.5, (masked), e^100, e^-100]:
    tis min(w, 2) = [2, 1.5, 0.5, 0, 2, e^-100]; mis = [0, 1.5, 0.5, 0, 0, e^-100]."""
    trainer = _t([[math.log(3), math.log(1.5), math.log(0.5), 50.0, 100.0, -100.0]], requires_grad=True)
    sampler = torch.zeros(1, 6, dtype=F64)
    mask = torch.tensor([[True, True, True, False, True, True]])
    tis = importance_weights(trainer, sampler, mask)
    mis = importance_weights(trainer, sampler, mask, mode="mis")
    _close(tis, [[2.0, 1.5, 0.5, 0.0, 2.0, math.exp(-100)]])
    _close(mis, [[0.0, 1.5, 0.5, 0.0, 0.0, math.exp(-100)]])
    assert not tis.requires_grad and not mis.requires_grad
    assert set(IMPORTANCE_WEIGHT_MODES) == {"tis", "mis"}


def test_importance_weight_float32_extremes_are_finite():
    trainer = torch.tensor([[100.0, -100.0]])
    for mode in IMPORTANCE_WEIGHT_MODES:
        w = importance_weights(trainer, torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), mode=mode, cap=5.0)
        assert torch.isfinite(w).all() and (w <= 5.0).all()


def test_importance_weight_errors():
    x, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"mode: expected one of .*'tis', 'mis'.*, got 'is'"):
        importance_weights(x, x, mask, mode="is")
    with pytest.raises(ValueError, match=r"cap: expected a finite number > 0, got 0"):
        importance_weights(x, x, mask, cap=0)
    with pytest.raises(ValueError, match=r"sampler_logp must have the mask's shape \(1, 2\); got \(1, 3\)"):
        importance_weights(x, torch.zeros(1, 3), mask)
    with pytest.raises(TypeError, match=r"mask must be a bool tensor"):
        importance_weights(x, x, mask.int())


def test_ess_spec_value():
    """w = [2, 1, 1, 0.5]: (4.5)^2 / (4 + 1 + 1 + 0.25) = 20.25 / 6.25 = 3.24."""
    lw = _t([math.log(2), 0.0, 0.0, math.log(0.5)])
    assert effective_sample_size(lw).item() == pytest.approx(3.24, abs=1e-12)


def test_ess_extremes_mask_and_empty():
    """Shifting all log-weights by +-100 changes nothing; [100, -100] is one dominant
    weight (ESS 1 + 2e^-200 ~ 1); masked entries are ignored; nothing valid gives 0."""
    lw = _t([math.log(2), 0.0, 0.0, math.log(0.5)])
    for shift in (100.0, -100.0):
        assert effective_sample_size(lw + shift).item() == pytest.approx(3.24, abs=1e-12)
    assert effective_sample_size(torch.tensor([100.0, -100.0])).item() == pytest.approx(1.0)
    padded = torch.cat([lw, _t([500.0, float("nan")])]).reshape(2, 3)
    mask = torch.tensor([True, True, True, True, False, False]).reshape(2, 3)
    assert effective_sample_size(padded, mask).item() == pytest.approx(3.24, abs=1e-12)
    assert effective_sample_size(padded, torch.zeros(2, 3, dtype=torch.bool)).item() == 0.0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=1, max_size=10))
def test_ess_matches_direct_formula_and_bounds(values):
    lw = _t(values)
    w = lw.exp()
    ess = effective_sample_size(lw).item()
    assert ess == pytest.approx((w.sum() ** 2 / (w**2).sum()).item(), rel=1e-10)
    assert 1.0 - 1e-12 <= ess <= len(values) + 1e-12


def test_ess_errors():
    with pytest.raises(ValueError, match=r"mask must have the shape of log_weights \(3,\); got \(2,\)"):
        effective_sample_size(torch.zeros(3), torch.ones(2, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"mask must be None or a bool tensor"):
        effective_sample_size(torch.zeros(3), torch.ones(3))
    with pytest.raises(TypeError, match=r"log_weights must be a torch.Tensor"):
        effective_sample_size([0.0, 1.0])
