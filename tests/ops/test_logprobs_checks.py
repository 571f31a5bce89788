"""Contract tests for tether.ops.logprobs beyond the math: the memory bound (checked by
counting allocations and saved tensors, not by RSS) and every argument check."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.ops.memory_probe import AllocationRecorder, saved_tensor_sizes
from tests.ops.test_logprobs import F64, make_head, naive_entropy, naive_logprobs
from tether.ops import (
    token_entropy,
    token_entropy_from_hidden,
    token_logprobs,
    token_logprobs_from_hidden,
    token_stats_from_hidden,
)

# ---------------------------------------------------------------------------------------
# Memory properties (deterministic: counted allocations and saved tensors, not RSS).


@pytest.mark.parametrize("with_entropy", [False, True])
def test_hidden_path_never_allocates_tokens_times_vocab(with_entropy):
    """N = 48 tokens, V = 40, H = 8, chunk 7: forward + backward (label log-probs alone, the
    factored fast path, or with entropy) allocate at most max(N*H, V*H, chunk*V) = 384
    elements at once, far below N*V = 1920, and save only hidden, weight, bias and [N]
    rows (labels, log-sum-exp, entropy). The naive path, probed the same way, does
    allocate and save N*V (so the probe can fail)."""
    n, vocab, width, chunk = 48, 40, 8, 7
    hidden, weight, b = make_head((2, 24), width, vocab, torch.float32, True)
    labels = torch.randint(0, vocab, (2, 24))

    def call():
        return token_stats_from_hidden(
            hidden, weight, labels, chunk_size=chunk, lm_head_bias=b, with_entropy=with_entropy
        )

    with AllocationRecorder() as rec:
        stats = call()
        loss = stats.log_probs.sum() + (stats.entropy.sum() if with_entropy else 0)
        loss.backward()
    assert rec.op_counts["scatter_add_"] == math.ceil(n / chunk)  # the probe saw backward
    assert rec.largest() == max(n * width, vocab * width, chunk * vocab) < n * vocab
    sizes, _ = saved_tensor_sizes(call)
    rows = [n, n, n] if with_entropy else [n, n]
    assert sorted(sizes) == sorted([n * width, vocab * width, vocab, *rows])

    with AllocationRecorder() as naive_rec:
        logits = F.linear(hidden, weight, b)
        (naive_logprobs(logits, labels).sum() + naive_entropy(logits).sum()).backward()
    assert naive_rec.largest() >= n * vocab
    naive_sizes, _ = saved_tensor_sizes(lambda: naive_logprobs(F.linear(hidden, weight, b), labels))
    assert max(naive_sizes) >= n * vocab


def test_logits_path_keeps_float32_work_chunked_for_bf16_logits():
    """For bf16 logits [N, V] the only N*V allocation is the bf16 gradient itself; no
    float32 tensor larger than chunk*V is ever built, and autograd saves no float32 copy."""
    n, vocab, chunk = 30, 20, 4
    logits = torch.randn(n, vocab).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (n,))
    with AllocationRecorder() as rec:
        lp = token_logprobs(logits, labels, chunk_size=chunk)
        ent = token_entropy(logits, chunk_size=chunk)
        (lp.sum() + ent.sum()).backward()
    assert rec.largest(torch.float32) == chunk * vocab
    assert rec.largest(torch.bfloat16) == n * vocab
    sizes, _ = saved_tensor_sizes(lambda: token_logprobs(logits, labels, chunk_size=chunk))
    assert sorted(sizes) == [n, n, n * vocab]  # labels, lse and the input logits


# ---------------------------------------------------------------------------------------
# Argument checks.


def _logits_call(**overrides):
    args = dict(logits=torch.randn(2, 3, 5), labels=torch.randint(0, 5, (2, 3)))
    args.update(overrides)
    return lambda: token_logprobs(args.pop("logits"), args.pop("labels"), **args)


def _hidden_call(**overrides):
    args = dict(
        hidden=torch.randn(2, 3, 4),
        lm_head_weight=torch.randn(5, 4),
        labels=torch.randint(0, 5, (2, 3)),
    )
    args.update(overrides)
    return lambda: token_stats_from_hidden(
        args.pop("hidden"), args.pop("lm_head_weight"), args.pop("labels"), **args
    )


@pytest.mark.parametrize("make", [_logits_call, _hidden_call])
@pytest.mark.parametrize(
    "overrides, error, name",
    [
        (dict(labels=torch.tensor([[0, 1, 5], [0, 0, 0]])), ValueError, "labels"),
        (dict(labels=torch.tensor([[0, -100, 1], [0, 0, 0]])), ValueError, "labels"),
        (dict(labels=torch.zeros(2, 3)), TypeError, "labels"),
        (dict(labels=torch.zeros(2, 3, dtype=torch.bool)), TypeError, "labels"),
        (dict(labels=torch.zeros(2, 4, dtype=torch.long)), ValueError, "labels"),
        (dict(labels=[[0, 1, 2]]), TypeError, "labels"),
        (dict(labels=torch.zeros(2, 3, dtype=torch.long, device="meta")), ValueError, "labels"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(temperature=float("inf")), ValueError, "temperature"),
        (dict(temperature=torch.tensor(1.0)), TypeError, "temperature"),
        (dict(temperature=True), TypeError, "temperature"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(chunk_size=-2), ValueError, "chunk_size"),
        (dict(chunk_size=2.5), TypeError, "chunk_size"),
        (dict(chunk_size=True), TypeError, "chunk_size"),
    ],
)
def test_shared_argument_errors(make, overrides, error, name):
    with pytest.raises(error, match=name):
        make(**overrides)()


@pytest.mark.parametrize(
    "overrides, error, name",
    [
        (dict(logits=torch.randint(0, 3, (2, 3, 5))), TypeError, "logits"),
        (dict(logits=torch.randn(5), labels=torch.tensor(0)), ValueError, "logits"),
        (dict(logits=torch.randn(2, 3, 0)), ValueError, "logits"),
        (dict(logits=[[0.0]]), TypeError, "logits"),
    ],
)
def test_logits_errors(overrides, error, name):
    with pytest.raises(error, match=name):
        _logits_call(**overrides)()


@pytest.mark.parametrize(
    "overrides, error, name",
    [
        (dict(chunk_size=None), TypeError, "chunk_size"),
        (dict(hidden=torch.randn(4)), ValueError, "hidden"),
        (dict(hidden=torch.ones(2, 3, 4, dtype=torch.long)), TypeError, "hidden"),
        (dict(lm_head_weight=torch.randn(5, 3)), ValueError, "lm_head_weight"),
        (dict(lm_head_weight=torch.randn(20)), ValueError, "lm_head_weight"),
        (dict(lm_head_weight=torch.randn(0, 4)), ValueError, "lm_head_weight"),
        (dict(lm_head_weight=torch.randn(5, 4, dtype=F64)), TypeError, "lm_head_weight"),
        (dict(lm_head_weight=torch.randn(5, 4, device="meta")), ValueError, "lm_head_weight"),
        (dict(lm_head_bias=torch.randn(4)), ValueError, "lm_head_bias"),
        (dict(lm_head_bias=torch.randn(5, dtype=F64)), TypeError, "lm_head_bias"),
        (dict(lm_head_bias=torch.ones(5, dtype=torch.long)), TypeError, "lm_head_bias"),
        (dict(with_entropy="yes"), TypeError, "with_entropy"),
    ],
)
def test_hidden_errors(overrides, error, name):
    with pytest.raises(error, match=name):
        _hidden_call(**overrides)()


def test_entropy_entry_points_check_arguments():
    with pytest.raises(ValueError, match="temperature"):
        token_entropy(torch.randn(2, 3), temperature=0)
    with pytest.raises(TypeError, match="logits"):
        token_entropy(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="lm_head_weight"):
        token_entropy_from_hidden(torch.randn(2, 4), torch.randn(5, 3))
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs_from_hidden(
            torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0, 1]), chunk_size=0
        )
