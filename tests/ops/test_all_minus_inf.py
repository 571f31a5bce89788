"""Positions whose logits are all ``-inf`` (issue 14): a named error, or a defined result.

The label functions already read one value back to the host (the label range check); that
same read now also refuses a position without any finite logit, naming it. The entropy
and exact-KL functions never sync: they return NaN at such a position (``+inf`` KL where
only the reference row is all ``-inf``) and a zero gradient there, so masking the position
out leaves every other gradient exact. Before, all of these were silent NaN, and a masked
NaN position still poisoned the whole gradient.
"""

from __future__ import annotations

import math

import pytest
import torch

from tether import ops

F64 = torch.float64
NEG = float("-inf")


def _logits(dead: tuple[int, int] = (1, 2)) -> torch.Tensor:
    """``[2, 3, 4]`` float64 logits with the position ``dead`` all ``-inf``."""
    logits = torch.randn(2, 3, 4, dtype=F64, generator=torch.Generator().manual_seed(0))
    logits[dead] = NEG
    return logits


def _head(dead: tuple[int, int] = (1, 2)):
    """Hidden ``[2, 3, 2]`` and a ``[4, 2]`` head whose logits are all ``-inf`` at ``dead``.

    Column 0 of the weight is all 1, so ``hidden[dead, 0] = -inf`` makes every logit of
    that position ``-inf + finite = -inf`` and leaves the other positions finite.
    """
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 3, 2, dtype=F64, generator=gen)
    weight = torch.randn(4, 2, dtype=F64, generator=gen)
    weight[:, 0] = 1.0
    hidden[dead + (0,)] = NEG
    return hidden, weight


def _naive_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


LABEL_ERROR = r"all -inf, e\.g\. at index \[\(1, 2\)\] of {src}\.shape\[:-1\] = \(2, 3\).*would be NaN"


@pytest.mark.parametrize("chunk_size", [None, 1, 4])
def test_token_logprobs_names_the_dead_position(chunk_size):
    """Before: log p = NaN at (1, 2), no message."""
    labels = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=LABEL_ERROR.format(src="logits")):
        ops.token_logprobs(_logits(), labels, chunk_size=chunk_size)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_hidden_label_functions_name_the_dead_position(with_entropy):
    hidden, weight = _head()
    labels = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=LABEL_ERROR.format(src="hidden")):
        ops.token_stats_from_hidden(hidden, weight, labels, chunk_size=2, with_entropy=with_entropy)
    with pytest.raises(ValueError, match=LABEL_ERROR.format(src="hidden")):
        ops.token_logprobs_from_hidden(hidden, weight, labels, chunk_size=2)


def test_out_of_range_labels_are_still_named_with_dead_positions_present():
    """The range error comes first (it is the caller's bug either way), and the forward no
    longer indexes with the bad id (``gather`` would fail first, a device assert on GPU)."""
    labels = torch.tensor([[0, 1, 2], [3, 4, 0]])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, V\) = \[0, 4\), got values in \[0, 4\]"):
        ops.token_logprobs(_logits(), labels)


def test_one_finite_logit_is_enough():
    """Row [-inf, 0, -inf, -inf]: p = onehot(1), log p_1 = 0, log p_0 = -inf; no error."""
    logits = torch.full((1, 4), NEG, dtype=F64)
    logits[0, 1] = 0.0
    assert ops.token_logprobs(logits, torch.tensor([1])).item() == 0.0
    assert ops.token_logprobs(logits, torch.tensor([0])).item() == -math.inf


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_token_entropy_is_nan_there_and_its_gradient_zero(chunk_size):
    """Entropy NaN at (1, 2) only; the other entries equal the naive entropy. With (1, 2)
    masked out (upstream gradient 0), the logits gradient is the naive one elsewhere and 0
    at (1, 2). Before: the gradient at (1, 2) was NaN although masked, and through a
    shared ``lm_head`` such a row spreads NaN to every parameter."""
    logits = _logits().requires_grad_()
    ent = ops.token_entropy(logits, chunk_size=chunk_size)
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[1, 2] = False
    assert torch.isnan(ent[1, 2]) and not torch.isnan(ent[keep]).any()
    torch.where(keep, ent, 0.0).sum().backward()
    live = _logits().detach().clone()
    live[1, 2] = 0.0
    live.requires_grad_()
    want = torch.where(keep, _naive_entropy(live), 0.0)
    want.sum().backward()
    torch.testing.assert_close(ent[keep], want[keep], rtol=0, atol=1e-12)
    torch.testing.assert_close(logits.grad[keep], live.grad[keep], rtol=0, atol=1e-12)
    assert torch.equal(logits.grad[1, 2], torch.zeros(4, dtype=F64))


def _dead_bias_head():
    """Finite hidden ``[2, 3, 2]`` and head ``[4, 2]`` with a bias of all ``-inf``: with
    finite hidden states and weights that is the one way every logit of a position is
    ``-inf``, and it makes every position dead."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 3, 2, dtype=F64, generator=gen).requires_grad_()
    weight = torch.randn(4, 2, dtype=F64, generator=gen).requires_grad_()
    bias = torch.full((4,), NEG, dtype=F64, requires_grad=True)
    return hidden, weight, bias


def test_entropy_from_hidden_masked_dead_positions_give_zero_gradients():
    """Every position dead: entropy NaN everywhere; with all of them masked out the
    gradients of hidden, weight and bias are exactly 0. Before: all NaN."""
    hidden, weight, bias = _dead_bias_head()
    ent = ops.token_entropy_from_hidden(hidden, weight, lm_head_bias=bias, chunk_size=4)
    assert torch.isnan(ent).all()
    torch.where(torch.zeros(2, 3, dtype=torch.bool), ent, 0.0).sum().backward()
    for grad in (hidden.grad, weight.grad, bias.grad):
        assert torch.equal(grad, torch.zeros_like(grad))


def test_exact_kl_dead_policy_row_is_nan_with_zero_gradient():
    """KL NaN where the policy row is all -inf (also when both are); exact elsewhere."""
    logits = _logits().requires_grad_()
    ref = torch.randn(2, 3, 4, dtype=F64, generator=torch.Generator().manual_seed(2))
    ref[0, 0] = NEG  # policy row (0, 0) is finite: KL +inf, see the next test
    ref[1, 2] = NEG  # both dead at (1, 2)
    kl = ops.exact_kl(logits, ref, chunk_size=2)
    assert torch.isnan(kl[1, 2]) and kl[0, 0] == math.inf
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[1, 2] = keep[0, 0] = False
    logp, logq = torch.log_softmax(logits.detach(), -1), torch.log_softmax(ref, -1)
    want = (logp.exp() * (logp - logq)).sum(-1)
    torch.testing.assert_close(kl[keep], want[keep], rtol=0, atol=1e-12)
    torch.where(keep, kl, 0.0).sum().backward()
    assert torch.equal(logits.grad[1, 2], torch.zeros(4, dtype=F64))
    assert torch.isfinite(logits.grad[keep]).all()


def test_exact_kl_dead_reference_row_is_plus_inf():
    """p = softmax([0, 0]) puts mass where q (all -inf) has none: KL = +inf, the true value
    (documented for a single forbidden entry). Before: NaN."""
    kl = ops.exact_kl(torch.zeros(1, 2, dtype=F64), torch.full((1, 2), NEG, dtype=F64))
    assert kl.item() == math.inf


def test_exact_kl_from_hidden_dead_policy_rows():
    """Policy bias all -inf: KL NaN at every position; masked out, zero gradients.
    A reference with an all -inf bias and a finite policy: KL +inf everywhere."""
    hidden, weight, bias = _dead_bias_head()
    ref_hidden = torch.randn(2, 3, 3, dtype=F64, generator=torch.Generator().manual_seed(3))
    ref_weight = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(4))
    kl = ops.exact_kl_from_hidden(hidden, weight, ref_hidden, ref_weight, lm_head_bias=bias, chunk_size=4)
    assert torch.isnan(kl).all()
    torch.where(torch.zeros(2, 3, dtype=torch.bool), kl, 0.0).sum().backward()
    for grad in (hidden.grad, weight.grad, bias.grad):
        assert torch.equal(grad, torch.zeros_like(grad))
    dead_ref = ops.exact_kl_from_hidden(
        hidden.detach(), weight.detach(), ref_hidden, ref_weight,
        ref_lm_head_bias=torch.full((4,), NEG, dtype=F64), chunk_size=4,
    )
    assert torch.isposinf(dead_ref).all()


def test_unchecked_hidden_functions_compute_the_same_and_name_nothing():
    """``checked=False`` (the scoring sink's later chunks) gives the checked values and gradients
    bit for bit on a well-formed chunk, and on a dead position returns NaN instead of raising: the
    caller checked its first chunk and trusts the rest."""
    from tether.ops import exact_kl_from_hidden, token_stats_from_hidden

    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    weight, ref_weight = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    labels, ref_hidden = torch.randint(0, 7, (2, 5)), torch.randn(2, 5, 4, dtype=torch.float64)
    outs = []
    for checked in (True, False):
        stats = token_stats_from_hidden(hidden, weight, labels, with_entropy=True, chunk_size=3, checked=checked)
        kl = exact_kl_from_hidden(hidden, weight, ref_hidden, ref_weight, chunk_size=3, checked=checked)
        grad, = torch.autograd.grad((stats.log_probs + stats.entropy + kl).sum(), hidden)
        outs.append((stats.log_probs, stats.entropy, kl, grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    dead = torch.full((7,), float("-inf"), dtype=torch.float64)
    with pytest.raises(ValueError, match="all -inf"):
        token_stats_from_hidden(hidden, weight, labels, lm_head_bias=dead)
    assert token_stats_from_hidden(hidden, weight, labels, lm_head_bias=dead, checked=False).log_probs.isnan().all()
