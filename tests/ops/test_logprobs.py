"""Tests for tether.ops.logprobs: hand-derived values, parity with full-logit references,
gradients and -inf handling. Memory and argument checks: test_logprobs_checks.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Categorical

from tests.ops.memory_probe import AllocationRecorder
from tether.ops import (
    TokenStats,
    token_entropy,
    token_entropy_from_hidden,
    token_logprobs,
    token_logprobs_from_hidden,
    token_stats_from_hidden,
)

F64 = torch.float64
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), F64: dict(atol=1e-12, rtol=1e-12)}
# Gradients of float32 sums over the vocabulary collect more rounding than the values.
GRAD_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), F64: dict(atol=1e-11, rtol=1e-11)}
SHAPES = [(5, 7), (2, 3, 11), (2, 2, 3, 6)]  # [..., T, V]
CHUNKS = [None, 1, 3, 1000]


def naive_logprobs(logits, labels, temperature=1.0):
    z = logits.to(F64 if logits.dtype == F64 else torch.float32) / temperature
    return z.log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)


def naive_entropy(logits, temperature=1.0):
    z = logits.to(F64 if logits.dtype == F64 else torch.float32) / temperature
    return Categorical(logits=z).entropy()


def make_head(lead, width, vocab, dtype, bias):
    hidden = torch.randn(*lead, width, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, width, dtype=dtype, requires_grad=True)
    b = torch.randn(vocab, dtype=dtype, requires_grad=True) if bias else None
    return hidden, weight, b


def grads_of(out, inputs):
    return torch.autograd.grad(out, [t for t in inputs if t is not None])


# ---------------------------------------------------------------------------------------
# Hand-derived values.


def test_hand_derived_logprobs_and_entropy_float64():
    """logits [1, 0, -1]: S = e + 1 + 1/e = 4.0861613, log S = 1.4076060, so
    log p = z - log S = [-0.4076060, -1.4076060, -2.4076060] and
    p = [0.6652410, 0.2447285, 0.0900306]; H = log S - sum p z = 1.4076060 - (0.6652410 -
    0.0900306) = 0.8323956.
    At temperature 2, z = [0.5, 0, -0.5]: S = e^0.5 + 1 + e^-0.5 = 3.2552519,
    log p_1 = -log S = -1.1802697, p = [0.5064804, 0.3071959, 0.1863237] and
    H = log S - 0.5 (p_0 - p_2) = 1.1802697 - 0.1600783 = 1.0201913."""
    logits = torch.tensor([[1.0, 0.0, -1.0]] * 3, dtype=F64)
    labels = torch.tensor([0, 1, 2])
    expected = torch.tensor([-0.4076060, -1.4076060, -2.4076060], dtype=F64)
    torch.testing.assert_close(token_logprobs(logits, labels), expected, atol=1e-7, rtol=0)
    torch.testing.assert_close(
        token_entropy(logits), torch.full((3,), 0.8323956, dtype=F64), atol=1e-7, rtol=0
    )
    lp_t2 = token_logprobs(logits[:1], labels[1:2], temperature=2.0)
    torch.testing.assert_close(lp_t2, torch.tensor([-1.1802697], dtype=F64), atol=1e-7, rtol=0)
    h_t2 = token_entropy(logits[:1], temperature=2.0, chunk_size=1)
    torch.testing.assert_close(h_t2, torch.tensor([1.0201913], dtype=F64), atol=1e-7, rtol=0)


def test_uniform_distribution_exact():
    """Four equal logits: p = 1/4 everywhere, so every label has log p = -log 4 and the
    entropy is log 4, whatever the temperature."""
    logits = torch.full((2, 4), 3.0, dtype=F64)
    for temperature in (0.5, 1.0, 3.0):
        lp = token_logprobs(logits, torch.tensor([0, 3]), temperature=temperature)
        torch.testing.assert_close(
            lp, torch.full((2,), -math.log(4), dtype=F64), atol=1e-15, rtol=0
        )
        ent = token_entropy(logits, temperature=temperature)
        torch.testing.assert_close(
            ent, torch.full((2,), math.log(4), dtype=F64), atol=1e-15, rtol=0
        )


def test_hidden_path_hand_derived():
    """hidden = [1, 2], W rows [1, 0], [0, 1], [0, 0], bias [0, -1, 0]: logits are
    [1, 2 - 1, 0] = [1, 1, 0], S = 2e + 1 = 6.4365637, log p_0 = 1 - log S = -0.8619948,
    log p_2 = -log S = -1.8619948; H = log S - 2e/S = 1.8619948 - 0.8446376 = 1.0173572."""
    hidden = torch.tensor([[1.0, 2.0], [1.0, 2.0]], dtype=F64)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=F64)
    bias = torch.tensor([0.0, -1.0, 0.0], dtype=F64)
    stats = token_stats_from_hidden(
        hidden, weight, torch.tensor([0, 2]), lm_head_bias=bias, with_entropy=True, chunk_size=1
    )
    torch.testing.assert_close(
        stats.log_probs, torch.tensor([-0.8619948, -1.8619948], dtype=F64), atol=1e-7, rtol=0
    )
    torch.testing.assert_close(
        stats.entropy, torch.full((2,), 1.0173572, dtype=F64), atol=1e-7, rtol=0
    )


# ---------------------------------------------------------------------------------------
# Parity with the naive full-logit computations.


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk_size", CHUNKS)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
def test_logits_path_matches_naive(dtype, shape, chunk_size, temperature):
    logits = torch.randn(*shape, dtype=dtype) * 3
    labels = torch.randint(0, shape[-1], shape[:-1])
    lp = token_logprobs(logits, labels, temperature=temperature, chunk_size=chunk_size)
    ent = token_entropy(logits, temperature=temperature, chunk_size=chunk_size)
    assert lp.dtype == dtype and ent.dtype == dtype
    torch.testing.assert_close(lp, naive_logprobs(logits, labels, temperature), **TOL[dtype])
    torch.testing.assert_close(ent, naive_entropy(logits, temperature), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_hidden_path_matches_naive(dtype, shape, chunk_size, bias):
    hidden, weight, b = make_head(shape[:-1], 5, shape[-1], dtype, bias)
    labels = torch.randint(0, shape[-1], shape[:-1])
    temperature = 0.8
    stats = token_stats_from_hidden(
        hidden,
        weight,
        labels,
        temperature=temperature,
        chunk_size=chunk_size,
        lm_head_bias=b,
        with_entropy=True,
    )
    logits = F.linear(hidden, weight, b)
    torch.testing.assert_close(
        stats.log_probs, naive_logprobs(logits, labels, temperature), **TOL[dtype]
    )
    torch.testing.assert_close(stats.entropy, naive_entropy(logits, temperature), **TOL[dtype])
    lp_only = token_logprobs_from_hidden(
        hidden, weight, labels, temperature=temperature, chunk_size=chunk_size, lm_head_bias=b
    )
    ent_only = token_entropy_from_hidden(
        hidden, weight, temperature=temperature, chunk_size=chunk_size, lm_head_bias=b
    )
    torch.testing.assert_close(lp_only, stats.log_probs, atol=0, rtol=0)
    torch.testing.assert_close(ent_only, stats.entropy, atol=0, rtol=0)


def test_stats_without_entropy_leave_it_none_and_match():
    hidden, weight, _ = make_head((3, 4), 6, 9, F64, False)
    labels = torch.randint(0, 9, (3, 4))
    stats = token_stats_from_hidden(hidden, weight, labels, chunk_size=5)
    assert isinstance(stats, TokenStats) and stats.entropy is None
    torch.testing.assert_close(
        stats.log_probs, naive_logprobs(hidden @ weight.T, labels), **TOL[F64]
    )


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_low_precision_model_reduces_in_float32(low):
    """A bf16/fp16 head gives float32 results equal to the naive ``lm_head(h).float()``
    route (same low-precision logits, float32 reductions), and parameter-dtype gradients."""
    hidden = torch.randn(3, 8, 16).to(low).requires_grad_()
    weight = (torch.randn(50, 16) / 4).to(low).requires_grad_()
    labels = torch.randint(0, 50, (3, 8))
    stats = token_stats_from_hidden(
        hidden, weight, labels, chunk_size=5, with_entropy=True, temperature=0.9
    )
    logits = F.linear(hidden, weight).float()
    ref_lp, ref_ent = naive_logprobs(logits, labels, 0.9), naive_entropy(logits, 0.9)
    assert stats.log_probs.dtype == torch.float32 and stats.entropy.dtype == torch.float32
    torch.testing.assert_close(stats.log_probs, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.entropy, ref_ent, atol=1e-5, rtol=1e-5)
    g_lp, g_ent = torch.randn(3, 8), torch.randn(3, 8)
    ours = grads_of((stats.log_probs * g_lp + stats.entropy * g_ent).sum(), [hidden, weight])
    ref = grads_of((ref_lp * g_lp + ref_ent * g_ent).sum(), [hidden, weight])
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == low
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    lp_only = token_logprobs_from_hidden(hidden, weight, labels, chunk_size=5, temperature=0.9)
    ours = grads_of((lp_only * g_lp).sum(), [hidden, weight])
    fresh_lp = naive_logprobs(F.linear(hidden, weight).float(), labels, 0.9)
    ref = grads_of((fresh_lp * g_lp).sum(), [hidden, weight])
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == low
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    lp_logits = token_logprobs(logits.to(low), labels, chunk_size=4)
    assert lp_logits.dtype == torch.float32
    torch.testing.assert_close(
        lp_logits, naive_logprobs(logits.to(low).float(), labels), atol=1e-5, rtol=1e-5
    )


# ---------------------------------------------------------------------------------------
# Gradients.

WHICH = ["log_probs", "entropy", "both"]


def _weighted(lp, ent, g_lp, g_ent, which):
    if which == "log_probs":
        return (lp * g_lp).sum()
    if which == "entropy":
        return (ent * g_ent).sum()
    return (lp * g_lp + ent * g_ent).sum()


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_hidden_gradients_match_naive_autograd(dtype, which, bias, chunk_size):
    hidden, weight, b = make_head((2, 5), 6, 13, dtype, bias)
    labels = torch.randint(0, 13, (2, 5))
    g_lp, g_ent = torch.randn(2, 5, dtype=dtype), torch.randn(2, 5, dtype=dtype)
    kwargs = dict(temperature=1.3, chunk_size=chunk_size, lm_head_bias=b)
    if which == "entropy":
        lp, ent = None, token_entropy_from_hidden(hidden, weight, **kwargs)
    else:
        stats = token_stats_from_hidden(
            hidden, weight, labels, with_entropy=which == "both", **kwargs
        )
        lp, ent = stats.log_probs, stats.entropy
    ours = grads_of(_weighted(lp, ent, g_lp, g_ent, which), [hidden, weight, b])
    logits = F.linear(hidden, weight, b)
    ref_loss = _weighted(
        naive_logprobs(logits, labels, 1.3), naive_entropy(logits, 1.3), g_lp, g_ent, which
    )
    ref = grads_of(ref_loss, [hidden, weight, b])
    for a, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, r, **GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_logits_gradients_match_naive_autograd(dtype, which, chunk_size):
    logits = (torch.randn(3, 4, 10, dtype=dtype) * 2).requires_grad_()
    labels = torch.randint(0, 10, (3, 4))
    g_lp, g_ent = torch.randn(3, 4, dtype=dtype), torch.randn(3, 4, dtype=dtype)
    lp = token_logprobs(logits, labels, temperature=0.6, chunk_size=chunk_size)
    ent = token_entropy(logits, temperature=0.6, chunk_size=chunk_size)
    (ours,) = grads_of(_weighted(lp, ent, g_lp, g_ent, which), [logits])
    ref_loss = _weighted(
        naive_logprobs(logits, labels, 0.6), naive_entropy(logits, 0.6), g_lp, g_ent, which
    )
    (ref,) = grads_of(ref_loss, [logits])
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, ref, **GRAD_TOL[dtype])


def test_gradcheck_float64():
    logits = torch.randn(2, 3, 5, dtype=F64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs(x, labels, temperature=0.7, chunk_size=2), (logits,)
    )
    assert torch.autograd.gradcheck(
        lambda x: token_entropy(x, temperature=1.9, chunk_size=4), (logits,)
    )
    hidden, weight, b = make_head((2, 3), 4, 5, F64, True)

    def stats(h, w, bb):
        s = token_stats_from_hidden(
            h, w, labels, temperature=0.7, chunk_size=4, lm_head_bias=bb, with_entropy=True
        )
        return s.log_probs, s.entropy

    assert torch.autograd.gradcheck(stats, (hidden, weight, b))
    assert torch.autograd.gradcheck(
        lambda h, w, bb: token_logprobs_from_hidden(
            h, w, labels, temperature=1.6, chunk_size=5, lm_head_bias=bb
        ),
        (hidden, weight, b),
    )


def test_frozen_head_skips_weight_matmuls_and_keeps_hidden_gradient():
    """With ``lm_head_weight`` frozen, backward runs one projection and one ``grad_z @ W``
    per chunk (2 matmuls) instead of three; the hidden gradient is unchanged."""
    hidden = torch.randn(10, 4, dtype=F64, requires_grad=True)
    weight = torch.randn(7, 4, dtype=F64)
    labels = torch.randint(0, 7, (10,))
    g = torch.randn(10, dtype=F64)
    lp = token_logprobs_from_hidden(hidden, weight, labels, chunk_size=3)  # 4 chunks
    with AllocationRecorder() as rec:
        (grad_h,) = torch.autograd.grad(lp, hidden, g)
    assert rec.op_counts["mm"] + rec.op_counts["addmm"] + rec.op_counts["addmm_"] == 2 * 4
    (ref,) = torch.autograd.grad(naive_logprobs(hidden @ weight.T, labels), hidden, g)
    torch.testing.assert_close(grad_h, ref, **GRAD_TOL[F64])
    weight.requires_grad_(True)
    lp = token_logprobs_from_hidden(hidden, weight, labels, chunk_size=3)
    with AllocationRecorder() as rec:
        torch.autograd.grad(lp, (hidden, weight), g)
    assert rec.op_counts["mm"] + rec.op_counts["addmm"] + rec.op_counts["addmm_"] == 3 * 4


def test_double_backward_is_refused():
    logits = torch.randn(2, 5, dtype=F64, requires_grad=True)
    lp = token_logprobs(logits, torch.tensor([1, 2]))
    with pytest.raises(NotImplementedError, match="create_graph"):
        torch.autograd.grad(lp.sum(), logits, create_graph=True)


# ---------------------------------------------------------------------------------------
# -inf logits and edge shapes.


def test_minus_inf_logits_give_no_nan():
    """-inf entries are outside the support: values equal those of the finite entries
    alone, and their gradient is exactly 0 (never NaN)."""
    logits = torch.randn(4, 6, dtype=F64)
    logits[:, [1, 4]] = float("-inf")
    logits = logits.requires_grad_()
    labels = torch.tensor([0, 2, 3, 5])
    stats_lp = token_logprobs(logits, labels, chunk_size=3)
    ent = token_entropy(logits, chunk_size=3)
    finite = logits.detach()[:, [0, 2, 3, 5]]
    torch.testing.assert_close(
        stats_lp, naive_logprobs(finite, torch.tensor([0, 1, 2, 3])), **TOL[F64]
    )
    torch.testing.assert_close(ent, naive_entropy(finite), **TOL[F64])
    (grad,) = torch.autograd.grad(stats_lp.sum() + ent.sum(), logits)
    assert torch.isfinite(grad).all()
    assert (grad[:, [1, 4]] == 0).all()


def test_label_on_minus_inf_logit_is_minus_inf_without_nan_gradient():
    """log p = -inf for a label outside the support; d log p_y / dz = onehot(y) - p stays
    finite: +1 at the label, -p elsewhere."""
    logits = torch.tensor([[0.0, 0.0, float("-inf")]], dtype=F64, requires_grad=True)
    lp = token_logprobs(logits, torch.tensor([2]))
    assert lp.item() == float("-inf")
    (grad,) = torch.autograd.grad(lp.sum(), logits)
    torch.testing.assert_close(
        grad, torch.tensor([[-0.5, -0.5, 1.0]], dtype=F64), atol=1e-15, rtol=0
    )


def test_hidden_path_minus_inf_bias_masks_entries():
    """A -inf bias entry removes that token from the support, as a vocabulary mask does."""
    hidden, weight, _ = make_head((3,), 4, 6, F64, False)
    bias = torch.zeros(6, dtype=F64)
    bias[2] = float("-inf")
    bias.requires_grad_()
    stats = token_stats_from_hidden(
        hidden, weight, torch.tensor([0, 1, 5]), lm_head_bias=bias, with_entropy=True, chunk_size=2
    )
    logits = F.linear(hidden, weight, bias)
    torch.testing.assert_close(stats.entropy, naive_entropy(logits), **TOL[F64])
    grads = grads_of(stats.log_probs.sum() + stats.entropy.sum(), [hidden, weight, bias])
    assert all(torch.isfinite(g).all() for g in grads)
    assert grads[2][2] == 0


def test_no_tokens_gives_empty_result_and_zero_gradients():
    hidden, weight, b = make_head((2, 0), 3, 5, F64, True)
    stats = token_stats_from_hidden(
        hidden, weight, torch.zeros(2, 0, dtype=torch.long), lm_head_bias=b, with_entropy=True
    )
    assert stats.log_probs.shape == (2, 0) and stats.entropy.shape == (2, 0)
    _, grad_w, grad_b = grads_of(stats.log_probs.sum() + stats.entropy.sum(), [hidden, weight, b])
    assert (grad_w == 0).all() and (grad_b == 0).all()
