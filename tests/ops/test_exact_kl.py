"""Tests for tether.ops.exact_kl: SPEC reference values, parity with a naive full-vocabulary
KL, its hand-written gradient, -inf handling, memory and argument checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.ops.memory_probe import AllocationRecorder, saved_tensor_sizes
from tether.ops import exact_kl, exact_kl_from_hidden

F64 = torch.float64
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), F64: dict(atol=1e-12, rtol=1e-12)}
GRAD_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), F64: dict(atol=1e-11, rtol=1e-11)}


def naive_kl(logits, ref_logits, temperature=1.0):
    """sum_v p_v (log p_v - log q_v) on the full logits with plain autograd."""
    dtype = F64 if F64 in (logits.dtype, ref_logits.dtype) else torch.float32
    logp = (logits.to(dtype) / temperature).log_softmax(-1)
    logq = (ref_logits.to(dtype) / temperature).log_softmax(-1)
    return (logp.exp() * (logp - logq)).sum(-1)


# ---------------------------------------------------------------------------------------
# Hand-derived values.


def test_spec_reference_value_and_gradient():
    """SPEC section 3: policy logits [1, 0, -1], reference [0, 0, 0]. With
    S = e + 1 + 1/e = 4.0861613: p = [0.6652410, 0.2447285, 0.0900306], log q = -log 3, so
    KL = sum p z - log S + log 3 = 0.5752103 - 1.4076060 + 1.0986123 = 0.266217.
    Gradient p_j (log p_j - log q_j - KL) = [0.282587, -0.140770, -0.141817]."""
    logits = torch.tensor([[1.0, 0.0, -1.0]], dtype=F64, requires_grad=True)
    kl = exact_kl(logits, torch.zeros(1, 3, dtype=F64))
    torch.testing.assert_close(kl, torch.tensor([0.266217], dtype=F64), atol=1e-6, rtol=0)
    (grad,) = torch.autograd.grad(kl.sum(), logits)
    expected = torch.tensor([[0.282587, -0.140770, -0.141817]], dtype=F64)
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)


def test_temperature_two_hand_derived():
    """Same logits at T = 2: z = [0.5, 0, -0.5], S = 3.2552519,
    p = [0.5064804, 0.3071959, 0.1863237]; KL = 0.5 (p_0 - p_2) - log S + log 3
    = 0.1600783 - 1.1802697 + 1.0986123 = 0.0784210. The gradient carries the chain-rule
    factor 1/T: p_j (log p_j + log 3 - KL) / 2 = [0.0860818, -0.0245877, -0.0614941]."""
    logits = torch.tensor([[1.0, 0.0, -1.0]], dtype=F64, requires_grad=True)
    kl = exact_kl(logits, torch.zeros(1, 3, dtype=F64), temperature=2.0)
    torch.testing.assert_close(kl, torch.tensor([0.0784210], dtype=F64), atol=1e-7, rtol=0)
    (grad,) = torch.autograd.grad(kl.sum(), logits)
    expected = torch.tensor([[0.0860818, -0.0245877, -0.0614941]], dtype=F64)
    torch.testing.assert_close(grad, expected, atol=1e-7, rtol=0)


def test_two_outcome_closed_form():
    """p = [1/2, 1/2] (logits [0, 0]) against q = [3/4, 1/4] (logits [log 3, 0]):
    KL = 1/2 log(2/3) + 1/2 log 2 = 1/2 log(4/3) = 0.1438410."""
    kl = exact_kl(torch.zeros(1, 2, dtype=F64), torch.tensor([[math.log(3.0), 0.0]], dtype=F64))
    torch.testing.assert_close(
        kl, torch.tensor([0.5 * math.log(4 / 3)], dtype=F64), atol=1e-15, rtol=0
    )


def test_hidden_variant_hand_derived():
    """Policy head rows [1, 0], [0, 1], [0, 0] on hidden [1, 0] with bias [0, 0, -1] give
    logits [1, 0, -1]; an all-zero reference head gives [0, 0, 0] whatever its hidden
    state: the SPEC case again, KL = 0.266217."""
    hidden = torch.tensor([[1.0, 0.0]], dtype=F64)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=F64)
    bias = torch.tensor([0.0, 0.0, -1.0], dtype=F64)
    ref_hidden = torch.tensor([[2.0, 3.0, 4.0]], dtype=F64)
    kl = exact_kl_from_hidden(
        hidden, weight, ref_hidden, torch.zeros(3, 3, dtype=F64), lm_head_bias=bias
    )
    torch.testing.assert_close(kl, torch.tensor([0.266217], dtype=F64), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------
# Parity and gradients.


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 11), (2, 2, 3, 6)])
@pytest.mark.parametrize("chunk_size", [None, 1, 3, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
def test_matches_naive_values_and_gradients(dtype, shape, chunk_size, temperature):
    logits = (torch.randn(*shape, dtype=dtype) * 2).requires_grad_()
    ref = torch.randn(*shape, dtype=dtype) * 2
    kl = exact_kl(logits, ref, temperature=temperature, chunk_size=chunk_size)
    expected = naive_kl(logits, ref, temperature)
    assert kl.dtype == dtype
    torch.testing.assert_close(kl, expected, **TOL[dtype])
    g = torch.randn(shape[:-1], dtype=dtype)
    (ours,) = torch.autograd.grad(kl, logits, g)
    (ref_grad,) = torch.autograd.grad(expected, logits, g)
    torch.testing.assert_close(ours, ref_grad, **GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_hidden_variant_matches_naive(dtype, chunk_size, bias):
    """The reference may have another hidden size; gradients reach the policy side only."""
    hidden = torch.randn(2, 5, 6, dtype=dtype, requires_grad=True)
    weight = torch.randn(13, 6, dtype=dtype, requires_grad=True)
    b = torch.randn(13, dtype=dtype, requires_grad=True) if bias else None
    ref_hidden = torch.randn(2, 5, 4, dtype=dtype, requires_grad=True)
    ref_weight = torch.randn(13, 4, dtype=dtype, requires_grad=True)
    ref_b = torch.randn(13, dtype=dtype) if bias else None
    kl = exact_kl_from_hidden(
        hidden,
        weight,
        ref_hidden,
        ref_weight,
        temperature=0.9,
        chunk_size=chunk_size,
        lm_head_bias=b,
        ref_lm_head_bias=ref_b,
    )
    expected = naive_kl(
        F.linear(hidden, weight, b), F.linear(ref_hidden, ref_weight, ref_b).detach(), 0.9
    )
    torch.testing.assert_close(kl, expected, **TOL[dtype])
    g = torch.randn(2, 5, dtype=dtype)
    policy = [t for t in (hidden, weight, b) if t is not None]
    ours = torch.autograd.grad(kl, policy + [ref_hidden, ref_weight], g, allow_unused=True)
    theirs = torch.autograd.grad(expected, policy, g)
    for a, r in zip(ours[: len(theirs)], theirs, strict=True):
        torch.testing.assert_close(a, r, **GRAD_TOL[dtype])
    assert ours[-2] is None and ours[-1] is None  # the reference is a constant


def test_reference_logits_receive_no_gradient():
    logits = torch.randn(3, 5, requires_grad=True)
    ref = torch.randn(3, 5, requires_grad=True)
    exact_kl(logits, ref).sum().backward()
    assert ref.grad is None and logits.grad is not None


def test_mixed_dtypes_reduce_in_float32():
    """bf16 policy logits against float32 reference logits: float32 KL equal to the naive
    KL of the upcast logits; the gradient comes back in bf16."""
    logits = torch.randn(4, 9).to(torch.bfloat16).requires_grad_()
    ref = torch.randn(4, 9)
    kl = exact_kl(logits, ref, chunk_size=3)
    assert kl.dtype == torch.float32
    expected = naive_kl(logits.float(), ref)
    torch.testing.assert_close(kl, expected, atol=1e-6, rtol=1e-6)
    (grad,) = torch.autograd.grad(kl.sum(), logits)
    (ref_grad,) = torch.autograd.grad(naive_kl(logits.float(), ref).sum(), logits)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-2, rtol=1e-2)


def test_gradcheck_float64():
    logits = torch.randn(2, 3, 5, dtype=F64, requires_grad=True)
    ref = torch.randn(2, 3, 5, dtype=F64)
    assert torch.autograd.gradcheck(
        lambda x: exact_kl(x, ref, temperature=0.7, chunk_size=2), (logits,)
    )
    hidden = torch.randn(2, 3, 4, dtype=F64, requires_grad=True)
    weight = torch.randn(5, 4, dtype=F64, requires_grad=True)
    bias = torch.randn(5, dtype=F64, requires_grad=True)
    ref_hidden, ref_weight = torch.randn(2, 3, 3, dtype=F64), torch.randn(5, 3, dtype=F64)
    assert torch.autograd.gradcheck(
        lambda h, w, b: exact_kl_from_hidden(
            h, w, ref_hidden, ref_weight, temperature=1.7, chunk_size=4, lm_head_bias=b
        ),
        (hidden, weight, bias),
    )


# ---------------------------------------------------------------------------------------
# Properties.


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_nonnegative_and_zero_for_identical_distributions(dtype):
    logits = torch.randn(64, 17, dtype=dtype) * 4
    ref = torch.randn(64, 17, dtype=dtype) * 4
    assert (exact_kl(logits, ref, chunk_size=5) >= 0).all()
    same = logits.clone().requires_grad_()
    kl = exact_kl(same, logits, chunk_size=5)
    assert (kl == 0).all()
    (grad,) = torch.autograd.grad(kl.sum(), same)
    assert (grad == 0).all()
    # softmax ignores a per-row shift, so the KL to a shifted copy is 0 up to rounding
    shifted = exact_kl(logits, logits + torch.randn(64, 1, dtype=dtype) * 10)
    torch.testing.assert_close(shifted, torch.zeros(64, dtype=dtype), **GRAD_TOL[dtype])


def test_shared_minus_inf_entries_give_no_nan():
    """-inf at the same entries on both sides (a shared vocabulary mask) is the KL of the
    remaining entries, with a finite gradient that is 0 on the masked entries."""
    logits = torch.randn(4, 7, dtype=F64)
    ref = torch.randn(4, 7, dtype=F64)
    logits[:, [0, 5]] = float("-inf")
    ref[:, [0, 5]] = float("-inf")
    logits.requires_grad_()
    kl = exact_kl(logits, ref, chunk_size=3)
    keep = [1, 2, 3, 4, 6]
    torch.testing.assert_close(kl, naive_kl(logits.detach()[:, keep], ref[:, keep]), **TOL[F64])
    (grad,) = torch.autograd.grad(kl.sum(), logits)
    assert torch.isfinite(grad).all() and (grad[:, [0, 5]] == 0).all()


def test_policy_only_minus_inf_entry_contributes_zero():
    """p_0 = 0 (policy logit -inf), q = [1/3, 1/3, 1/3]: p = [0, 1/2, 1/2] and
    KL = 2 * 1/2 * log(3/2) = log 1.5 = 0.4054651; the masked entry has gradient 0."""
    logits = torch.tensor([[float("-inf"), 0.0, 0.0]], dtype=F64, requires_grad=True)
    kl = exact_kl(logits, torch.zeros(1, 3, dtype=F64))
    torch.testing.assert_close(kl, torch.tensor([math.log(1.5)], dtype=F64), atol=1e-15, rtol=0)
    (grad,) = torch.autograd.grad(kl.sum(), logits)
    assert torch.isfinite(grad).all() and grad[0, 0] == 0


def test_mass_on_reference_forbidden_entry_is_plus_inf():
    """p_0 > 0 where q_0 = 0: the true KL is +inf, and that is what comes back."""
    kl = exact_kl(torch.zeros(1, 3), torch.tensor([[float("-inf"), 0.0, 0.0]]))
    assert kl.item() == float("inf")


def test_nan_input_stays_visible():
    """A NaN logit must not be silently masked into a finite KL."""
    logits = torch.zeros(2, 4)
    logits[1, 2] = float("nan")
    kl = exact_kl(logits, torch.zeros(2, 4))
    assert kl[0] == 0 and torch.isnan(kl[1])


def test_hidden_variant_never_allocates_tokens_times_vocab():
    """N = 40, V = 48, H = 6, H_ref = 5, chunk 6: forward + backward allocate at most
    max(N*H, V*H, chunk*V) = 288 elements at once, below N*V = 1920; autograd saves only
    the two hidden tensors, the two weights and the bias."""
    n, vocab, chunk = 40, 48, 6
    hidden = torch.randn(4, 10, 6, requires_grad=True)
    weight = torch.randn(vocab, 6, requires_grad=True)
    bias = torch.randn(vocab, requires_grad=True)
    ref_hidden, ref_weight = torch.randn(4, 10, 5), torch.randn(vocab, 5)
    call = lambda: exact_kl_from_hidden(  # noqa: E731
        hidden, weight, ref_hidden, ref_weight, chunk_size=chunk, lm_head_bias=bias
    )
    with AllocationRecorder() as rec:
        call().sum().backward()
    assert rec.op_counts["addmm_"] == math.ceil(n / chunk)  # the probe saw backward
    assert rec.largest() == max(n * 6, vocab * 6, chunk * vocab) < n * vocab
    sizes, _ = saved_tensor_sizes(call)
    assert sorted(sizes) == sorted([n * 6, vocab * 6, vocab, n * 5, vocab * 5])


# ---------------------------------------------------------------------------------------
# Argument checks.


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(ref_logits=torch.randn(2, 3, 4)), ValueError, "ref_logits"),
        (dict(ref_logits=torch.ones(2, 3, 5, dtype=torch.long)), TypeError, "ref_logits"),
        (dict(ref_logits=torch.randn(2, 3, 5, device="meta")), ValueError, "ref_logits"),
        (dict(logits=torch.ones(2, 3, 5, dtype=torch.long)), TypeError, "logits"),
        (dict(logits=torch.randn(5), ref_logits=torch.randn(5)), ValueError, "logits"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature="1"), TypeError, "temperature"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(chunk_size=1.0), TypeError, "chunk_size"),
    ],
)
def test_exact_kl_errors(kwargs, error, name):
    args = dict(logits=torch.randn(2, 3, 5), ref_logits=torch.randn(2, 3, 5))
    args.update(kwargs)
    with pytest.raises(error, match=name):
        exact_kl(args.pop("logits"), args.pop("ref_logits"), **args)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(ref_hidden=torch.randn(2, 4, 3)), ValueError, "ref_hidden"),
        (dict(ref_hidden=torch.randn(2, 3, 3, dtype=F64)), TypeError, "ref_lm_head_weight"),
        (dict(ref_lm_head_weight=torch.randn(6, 3)), ValueError, "ref_lm_head_weight"),
        (dict(ref_lm_head_weight=torch.randn(5, 2)), ValueError, "ref_lm_head_weight"),
        (dict(ref_lm_head_bias=torch.randn(4)), ValueError, "ref_lm_head_bias"),
        (dict(lm_head_weight=torch.randn(5, 3)), ValueError, "lm_head_weight"),
        (dict(lm_head_bias=torch.randn(5, dtype=F64)), TypeError, "lm_head_bias"),
        (dict(hidden=torch.randn(4)), ValueError, "hidden"),
        (
            dict(
                ref_hidden=torch.randn(2, 3, 3, device="meta"),
                ref_lm_head_weight=torch.randn(5, 3, device="meta"),
            ),
            ValueError,
            "ref_hidden",
        ),
        (dict(temperature=-0.5), ValueError, "temperature"),
        (dict(chunk_size=None), TypeError, "chunk_size"),
    ],
)
def test_exact_kl_from_hidden_errors(kwargs, error, name):
    args = dict(
        hidden=torch.randn(2, 3, 4),
        lm_head_weight=torch.randn(5, 4),
        ref_hidden=torch.randn(2, 3, 3),
        ref_lm_head_weight=torch.randn(5, 3),
    )
    args.update(kwargs)
    positional = [
        args.pop(k) for k in ("hidden", "lm_head_weight", "ref_hidden", "ref_lm_head_weight")
    ]
    with pytest.raises(error, match=name):
        exact_kl_from_hidden(*positional, **args)
