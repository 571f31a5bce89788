"""Exact full-vocabulary KL(pi || pi_ref) per token, chunked, with a hand-written gradient.

The sampled estimators in ``tether.ops.kl`` see one token per position; this sums over the
whole vocabulary instead, ``KL = sum_v p_v (log p_v - log q_v)`` with
``p = softmax(logits / T)`` and ``q = softmax(ref_logits / T)``. The gradient w.r.t. the
policy logits is ``dKL/dz_j = p_j (log p_j - log q_j - KL) / T``; the reference is treated
as a constant (no gradient reaches ``ref_logits`` or the reference head even when they
require grad), which is what a KL leash to a frozen model wants.

Numerics: vocabulary sums run in float32 (float64 if either side is float64). Entries
where ``p`` is 0 (in particular ``-inf`` policy logits, e.g. from a shared vocabulary
mask) contribute exactly 0, so ``-inf`` at the same entries on both sides gives no NaN.
A token where the policy puts mass (``p > 0`` in the compute dtype) on an entry the
reference forbids (``q == 0``) has KL ``+inf``, the true value; its gradient is then not
finite and such a token must be masked or its cause fixed. That includes a reference row
of all ``-inf``. A policy row of all ``-inf`` defines no distribution: its KL is NaN and
its gradient 0, so a masked-out row of that kind leaves the others' gradients finite
(raising instead would cost a host sync per call, which this function does not have).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tether.ops._vocab_chunks import (
    HeadGrads,
    first_order_only,
    head_logits,
    load_logits,
    shift_max_,
)
from tether.ops.checks import (
    check_chunk_size,
    check_head,
    check_logits,
    check_same_device,
    check_temperature,
    compute_dtype,
)
from tether.ops.logprobs import DEFAULT_CHUNK_SIZE
from tether.ops.masks import row_slices


def _log_softmax_(z: Tensor, spare: Tensor) -> Tensor:
    """Turn ``z`` into ``log_softmax(z)`` in place; ``spare`` receives ``exp(z - max)``.

    Returns the row sums ``[C, 1]`` of ``spare`` (so ``spare / sums`` is the softmax).
    """
    shift_max_(z)
    total = torch.exp(z, out=spare).sum(-1, keepdim=True)
    # A row of all -inf (total 0) stays all -inf: log q = -inf for every entry.
    z.sub_(total.log().masked_fill_(total == 0, 0.0))
    return total


def _chunk_kl(z: Tensor, y: Tensor, spare: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """KL ``[C]``, ``p`` and ``log p - log q`` ``[C, V]`` for scaled logits ``z``, ``y``.

    Overwrites all three ``[C, V]`` buffers: ``p`` ends in ``spare``, the log-ratio in ``z``.
    """
    _log_softmax_(y, spare)
    total = _log_softmax_(z, spare)
    # total >= 1 wherever the row has a finite max (that entry adds exp(0)); a policy row
    # of all -inf (total 0) defines no distribution: p = 0 there (so its gradient is 0)
    # and its KL is set to NaN below rather than to a made-up number.
    p = spare.div_(total.clamp_min(1.0))
    diff = z.sub_(y)
    # Entries with p == 0 hold (-inf) - (-inf) = NaN or -inf - finite; their term is 0.
    # Masking on p == 0 rather than keeping p > 0 lets NaN inputs stay visible as NaN.
    terms = torch.mul(p, diff, out=y).masked_fill_(p == 0, 0.0)
    kl = terms.sum(-1).masked_fill_(total.squeeze(-1) == 0, float("nan"))
    return kl, p, diff


def _chunk_kl_grad(z: Tensor, y: Tensor, spare: Tensor, g: Tensor) -> Tensor:
    """Gradient w.r.t. ``z`` of ``sum(g * KL)``; ``g`` already carries ``1/temperature``."""
    kl, p, diff = _chunk_kl(z, y, spare)
    grad = diff.sub_(kl[:, None]).mul_(p).mul_(g[:, None])
    return grad.masked_fill_(p == 0, 0.0)


class _KLScratch:
    """Three reusable ``[C, V]`` buffers: policy logits, reference logits, probabilities."""

    def __init__(self, rows: int, vocab: int, like: Tensor, dtype: torch.dtype):
        self.buffers = [like.new_empty(rows, vocab, dtype=dtype) for _ in range(3)]

    def take(self, rows: int) -> list[Tensor]:
        return [b[:rows] for b in self.buffers]


def _kl_forward(load_z, load_y, like, n, vocab, dtype, chunk_size) -> Tensor:
    kl = like.new_empty(n, dtype=dtype)
    scratch = _KLScratch(min(chunk_size, n), vocab, like, dtype)
    for start, stop in row_slices(n, chunk_size):
        z, y, spare = scratch.take(stop - start)
        kl[start:stop] = _chunk_kl(load_z(start, stop, z), load_y(start, stop, y), spare)[0]
    return kl


def _kl_backward(load_z, load_y, consume, like, n, vocab, dtype, chunk_size, g) -> None:
    scratch = _KLScratch(min(chunk_size, n), vocab, like, dtype)
    for start, stop in row_slices(n, chunk_size):
        z, y, spare = scratch.take(stop - start)
        grad_z = _chunk_kl_grad(
            load_z(start, stop, z), load_y(start, stop, y), spare, g[start:stop]
        )
        consume(slice(start, stop), grad_z)


class _LogitsKL(torch.autograd.Function):
    """Per-token KL from full logits; saves the two inputs and nothing else."""

    @staticmethod
    def forward(ctx, logits, ref_logits, temperature, chunk_size):
        dtype = compute_dtype(logits.dtype, ref_logits.dtype)
        n, vocab = logits.shape
        kl = _kl_forward(
            lambda a, b, out: load_logits(logits[a:b], temperature, out),
            lambda a, b, out: load_logits(ref_logits[a:b], temperature, out),
            logits,
            n,
            vocab,
            dtype,
            chunk_size,
        )
        ctx.save_for_backward(logits, ref_logits)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        return kl

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        logits, ref_logits = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        temperature = ctx.temperature
        grad = torch.empty_like(logits)

        def consume(rows, grad_z):
            grad[rows] = grad_z

        _kl_backward(
            lambda a, b, out: load_logits(logits[a:b], temperature, out),
            lambda a, b, out: load_logits(ref_logits[a:b], temperature, out),
            consume,
            logits,
            logits.shape[0],
            logits.shape[1],
            ctx.dtype,
            ctx.chunk_size,
            g.to(ctx.dtype) / temperature,
        )
        return grad, None, None, None


class _HiddenKL(torch.autograd.Function):
    """Per-token KL from two (hidden, lm_head) pairs; never builds full logits of either.

    Gradients flow to the policy hidden states, weight and bias only.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, ref_hidden, ref_weight, ref_bias, temperature, chunk_size
    ):
        dtype = compute_dtype(hidden.dtype, ref_hidden.dtype)
        kl = _kl_forward(
            lambda a, b, out: head_logits(hidden[a:b], weight, bias, temperature, out),
            lambda a, b, out: head_logits(ref_hidden[a:b], ref_weight, ref_bias, temperature, out),
            hidden,
            hidden.shape[0],
            weight.shape[0],
            dtype,
            chunk_size,
        )
        ctx.save_for_backward(hidden, weight, bias, ref_hidden, ref_weight, ref_bias)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        return kl

    @staticmethod
    @first_order_only
    def backward(ctx, g):
        hidden, weight, bias, ref_hidden, ref_weight, ref_bias = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        nothing = (None,) * 5
        if not (need_h or need_w or need_b):
            return (None, None, None, *nothing)
        temperature, dtype = ctx.temperature, ctx.dtype
        grads = HeadGrads(hidden, weight, bias, need_h, need_w, need_b, dtype)
        _kl_backward(
            lambda a, b, out: head_logits(hidden[a:b], weight, bias, temperature, out),
            lambda a, b, out: head_logits(ref_hidden[a:b], ref_weight, ref_bias, temperature, out),
            grads.accumulate,
            hidden,
            hidden.shape[0],
            weight.shape[0],
            dtype,
            ctx.chunk_size,
            g.to(dtype) / temperature,
        )
        return (*grads.result(), *nothing)


def exact_kl(
    logits: Tensor,
    ref_logits: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> Tensor:
    """Full-vocabulary ``KL(softmax(logits/T) || softmax(ref_logits/T))`` per token.

    Args:
        logits: ``[..., T, V]`` policy logits, floating point.
        ref_logits: ``[..., T, V]`` reference logits (same shape; dtype may differ). Treated
            as a constant: it never receives a gradient.
        temperature: > 0, applied to both sides.
        chunk_size: tokens per chunk; ``None`` processes all tokens at once.

    Returns:
        ``[..., T]`` float32 (float64 if either input is float64), ``>= 0``; ``+inf`` where
        the policy gives mass to an entry whose reference logit is ``-inf``; NaN (with a
        zero gradient) where the policy logits are all ``-inf``.
        Differentiable w.r.t. ``logits`` with ``p * (log p - log q - KL) / T``.
    """
    temperature = check_temperature(temperature)
    chunk_size = check_chunk_size(chunk_size, allow_none=True)
    check_logits("logits", logits)
    check_logits("ref_logits", ref_logits)
    if ref_logits.shape != logits.shape:
        raise ValueError(
            f"ref_logits must have the shape of logits {tuple(logits.shape)}, got "
            f"{tuple(ref_logits.shape)}; score the same tokens with both models"
        )
    check_same_device("ref_logits", ref_logits, "logits", logits)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    chunk = chunk_size if chunk_size is not None else max(lead.numel(), 1)
    kl = _LogitsKL.apply(
        logits.reshape(-1, vocab), ref_logits.reshape(-1, vocab), temperature, chunk
    )
    return kl.reshape(lead)


def _check_hidden_pair(
    hidden: Tensor,
    lm_head_weight: Tensor,
    lm_head_bias: Tensor | None,
    ref_hidden: Tensor,
    ref_lm_head_weight: Tensor,
    ref_lm_head_bias: Tensor | None,
) -> None:
    """Each side a well-formed head, and the two sides scoring the same tokens and vocabulary."""
    check_head(hidden, lm_head_weight, lm_head_bias, "hidden", "lm_head_weight", "lm_head_bias")
    check_head(
        ref_hidden,
        ref_lm_head_weight,
        ref_lm_head_bias,
        "ref_hidden",
        "ref_lm_head_weight",
        "ref_lm_head_bias",
    )
    if ref_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"ref_hidden must have the leading shape of hidden {tuple(hidden.shape[:-1])}, "
            f"got {tuple(ref_hidden.shape[:-1])}; run both models on the same tokens"
        )
    if ref_lm_head_weight.shape[0] != lm_head_weight.shape[0]:
        raise ValueError(
            f"ref_lm_head_weight must have the vocabulary size of lm_head_weight "
            f"({lm_head_weight.shape[0]}), got {ref_lm_head_weight.shape[0]}; the two models "
            "must share a tokenizer"
        )
    check_same_device("ref_hidden", ref_hidden, "hidden", hidden)


def exact_kl_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    ref_hidden: Tensor,
    ref_lm_head_weight: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    lm_head_bias: Tensor | None = None,
    ref_lm_head_bias: Tensor | None = None,
    checked: bool = True,
) -> Tensor:
    """:func:`exact_kl` of the two models' logits, computed from their last hidden states.

    Both heads are projected ``chunk_size`` tokens at a time, in the forward and again in
    the backward, so neither ``[..., T, V]`` logits tensor is ever built.

    Args:
        hidden: ``[..., T, H]`` policy hidden states.
        lm_head_weight: ``[V, H]`` policy head, dtype and device of ``hidden``.
        ref_hidden: ``[..., T, H_ref]`` reference hidden states (same leading shape;
            ``H_ref`` may differ from ``H``). Constant: receives no gradient.
        ref_lm_head_weight: ``[V, H_ref]`` reference head (same ``V``). Constant.
        temperature: > 0, applied to both sides.
        chunk_size: tokens per chunk (> 0).
        lm_head_bias, ref_lm_head_bias: optional ``[V]`` biases of the two heads.
        checked: False skips the argument checks, for a caller that checked the same heads,
            temperature and chunk size on an earlier chunk of one batch.

    Returns:
        ``[..., T]`` float32 (float64 if either side is float64), differentiable w.r.t.
        ``hidden``, ``lm_head_weight`` and ``lm_head_bias``.
    """
    if checked:
        temperature = check_temperature(temperature)
        chunk_size = check_chunk_size(chunk_size, allow_none=False)
        _check_hidden_pair(hidden, lm_head_weight, lm_head_bias, ref_hidden, ref_lm_head_weight, ref_lm_head_bias)
    lead = hidden.shape[:-1]
    kl = _HiddenKL.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        lm_head_weight,
        lm_head_bias,
        ref_hidden.reshape(-1, ref_hidden.shape[-1]),
        ref_lm_head_weight,
        ref_lm_head_bias,
        temperature,
        chunk_size,
    )
    return kl.reshape(lead)
