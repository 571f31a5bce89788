"""The categorical distribution over the vocabulary: label log-probs and entropies, chunked over
tokens, and one token drawn from each row's probabilities (``draw_categorical``).

Reductions over the vocabulary run in float32 whatever the model dtype (float64 stays
float64). Tokens are processed ``chunk_size`` at a time and every backward pass recomputes
its chunk instead of reading saved activations, so no float32 ``[..., T, V]`` tensor for all
tokens ever exists. The ``*_from_hidden`` variants also fold in the ``lm_head`` projection:
they never build the full logits in any dtype, which for a vocabulary of 50k-150k is where
most of the memory of a naive ``lm_head`` + ``log_softmax`` + ``gather`` goes.

The label functions make one host synchronisation, after the forward: it checks that the
labels lie in ``[0, V)`` (an out-of-range id would otherwise surface as an opaque index
error, or a device-side assert on GPU) and that no position has all its logits ``-inf``
(no distribution: NaN log-probs), and raises a ``ValueError`` naming the fault. The
entropy-only functions make none: there such a position has entropy NaN and a zero
gradient, so masking it out keeps every other gradient finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tether.ops._vocab_chunks import (
    HeadGrads,
    first_order_only,
    head_logits,
    label_grad_backward,
    load_logits,
    stats_backward,
    stats_forward,
)
from tether.ops.checks import (
    check_chunk_size,
    check_head,
    check_labels,
    check_logits,
    check_scored,
    check_temperature,
    compute_dtype,
)

DEFAULT_CHUNK_SIZE = 1024


@dataclass(frozen=True)
class TokenStats:
    """Per-token statistics of ``softmax(logits / temperature)``.

    ``log_probs``: ``[..., T]`` log-probability of each label. ``entropy``: ``[..., T]``
    entropy of the whole distribution, or ``None`` when it was not asked for. Both are
    float32 (float64 when the inputs are float64).
    """

    log_probs: Tensor
    entropy: Tensor | None = None


# ---------------------------------------------------------------------------------------
# Autograd functions. Inputs are flattened to ``[N, V]`` / ``[N, H]``; outputs are ``[N]``.


class _LogitsStats(torch.autograd.Function):
    """Label log-probs and/or entropy from full logits, saving only logits and ``[N]`` rows."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size, want_entropy):
        def load(start, stop, out):
            return load_logits(logits[start:stop], temperature, out)

        n, vocab = logits.shape
        log_probs, lse, entropy = stats_forward(
            load, logits, n, vocab, compute_dtype(logits.dtype), chunk_size, labels, want_entropy
        )
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return log_probs, entropy, lse

    @staticmethod
    @first_order_only
    def backward(ctx, g_lp, g_ent, _g_lse):
        logits, labels, lse, entropy = ctx.saved_tensors
        if (g_lp is None and g_ent is None) or not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        temperature = ctx.temperature

        def load(start, stop, out):
            return load_logits(logits[start:stop], temperature, out)

        # The gradient itself is [N, V] in the logits dtype; only the float32 work is chunked.
        grad = torch.empty_like(logits)

        def consume(rows, grad_z):
            grad[rows] = grad_z

        stats_backward(
            load,
            consume,
            logits,
            logits.shape[1],
            ctx.chunk_size,
            (lse, entropy, labels),
            g_lp,
            g_ent,
            temperature,
        )
        return grad, None, None, None, None


class _HiddenStats(torch.autograd.Function):
    """Label log-probs and/or entropy from hidden states and the ``lm_head`` parameters.

    Saves hidden ``[N, H]``, weight ``[V, H]``, bias, labels and ``[N]`` rows (log-sum-exp,
    entropy); backward recomputes each chunk's logits.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, want_entropy):
        def load(start, stop, out):
            return head_logits(hidden[start:stop], weight, bias, temperature, out)

        log_probs, lse, entropy = stats_forward(
            load,
            hidden,
            hidden.shape[0],
            weight.shape[0],
            compute_dtype(hidden.dtype),
            chunk_size,
            labels,
            want_entropy,
        )
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return log_probs, entropy, lse

    @staticmethod
    @first_order_only
    def backward(ctx, g_lp, g_ent, _g_lse):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (g_lp is None and g_ent is None) or not (need_h or need_w or need_b):
            return None, None, None, None, None, None, None
        temperature = ctx.temperature

        def load(start, stop, out):
            return head_logits(hidden[start:stop], weight, bias, temperature, out)

        grads = HeadGrads(hidden, weight, bias, need_h, need_w, need_b, lse.dtype)
        if g_ent is None:
            label_grad_backward(
                hidden, weight, bias, labels, lse, g_lp, temperature, ctx.chunk_size, grads
            )
            return (*grads.result(), None, None, None, None)
        stats_backward(
            load,
            grads.accumulate,
            hidden,
            weight.shape[0],
            ctx.chunk_size,
            (lse, entropy, labels),
            g_lp,
            g_ent,
            temperature,
        )
        return (*grads.result(), None, None, None, None)


# ---------------------------------------------------------------------------------------
# Public API.


def _in_vocab(labels: Tensor | None, vocab: int) -> Tensor | None:
    """Labels clamped into ``[0, V)`` for the kernels; the originals are checked afterwards."""
    return None if labels is None else labels.clamp(0, vocab - 1)


def _stats_from_logits(logits, labels, temperature, chunk_size, want_entropy) -> TokenStats:
    temperature = check_temperature(temperature)
    chunk_size = check_chunk_size(chunk_size, allow_none=True)
    check_logits("logits", logits)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    flat_labels = None
    if labels is not None:
        flat_labels = check_labels(labels, lead, logits.device, "logits").reshape(-1)
    chunk = chunk_size if chunk_size is not None else max(lead.numel(), 1)
    log_probs, entropy, lse = _LogitsStats.apply(
        logits.reshape(-1, vocab), _in_vocab(flat_labels, vocab), temperature, chunk, want_entropy
    )
    if flat_labels is not None:
        check_scored(flat_labels, vocab, lse, lead, "logits")
    return TokenStats(
        log_probs=None if log_probs is None else log_probs.reshape(lead),
        entropy=None if entropy is None else entropy.reshape(lead),
    )


def token_logprobs(
    logits: Tensor, labels: Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> Tensor:
    """Log-probability of each label under ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., T, V]`` floating point, any dtype.
        labels: ``[..., T]`` integer ids in ``[0, V)``. Positions that will be masked out may
            hold any valid id. No shift is applied: ``out[..., t]`` scores ``labels[..., t]``
            under ``logits[..., t, :]``; callers align.
        temperature: > 0, the sampling temperature.
        chunk_size: tokens per chunk; ``None`` processes all tokens at once.

    Returns:
        ``[..., T]`` float32 (float64 if ``logits`` are float64). Differentiable w.r.t.
        ``logits``; backward recomputes each chunk rather than saving float32 copies.

    Raises:
        ValueError: a label outside ``[0, V)``, or a position whose logits are all ``-inf``
            (it names the position).
    """
    return _stats_from_logits(logits, labels, temperature, chunk_size, False).log_probs


def token_entropy(
    logits: Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> Tensor:
    """Entropy ``-sum_v p_v log p_v`` of ``p = softmax(logits / temperature)`` per token.

    ``logits`` ``[..., T, V]`` -> ``[..., T]`` float32 (float64 if ``logits`` are float64).
    Entries with a ``-inf`` logit contribute 0. Differentiable w.r.t. ``logits``. A
    position whose logits are all ``-inf`` has no distribution: its entropy is NaN and its
    gradient 0 (no error: unlike the label functions this one never syncs with the host).
    """
    return _stats_from_logits(logits, None, temperature, chunk_size, True).entropy


def _stats_from_hidden(
    hidden, weight, bias, labels, temperature, chunk_size, want_entropy, checked=True
) -> TokenStats:
    if checked:
        temperature = check_temperature(temperature)
        chunk_size = check_chunk_size(chunk_size, allow_none=False)
        check_head(hidden, weight, bias, "hidden", "lm_head_weight", "lm_head_bias")
    lead, width, vocab = hidden.shape[:-1], hidden.shape[-1], weight.shape[0]
    flat_labels = None
    if labels is not None:
        flat_labels = (check_labels(labels, lead, hidden.device, "hidden") if checked else labels).reshape(-1)
    log_probs, entropy, lse = _HiddenStats.apply(
        hidden.reshape(-1, width),
        weight,
        bias,
        _in_vocab(flat_labels, vocab),
        temperature,
        chunk_size,
        want_entropy,
    )
    if flat_labels is not None and checked:
        check_scored(flat_labels, vocab, lse, lead, "hidden")
    return TokenStats(
        log_probs=None if log_probs is None else log_probs.reshape(lead),
        entropy=None if entropy is None else entropy.reshape(lead),
    )


def token_stats_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    lm_head_bias: Tensor | None = None,
    with_entropy: bool = False,
    checked: bool = True,
) -> TokenStats:
    """Label log-probs (and optionally entropies) straight from the last hidden states.

    Equivalent to ``token_logprobs(F.linear(hidden, lm_head_weight, lm_head_bias), labels)``
    (and ``token_entropy``) but never materialises the ``[..., T, V]`` logits: the forward
    projects ``chunk_size`` tokens at a time and keeps only ``[..., T]`` rows, and the
    backward projects each chunk again to form its gradients.

    Args:
        hidden: ``[..., T, H]`` final hidden states (after the model's final norm).
        lm_head_weight: ``[V, H]``, same dtype and device as ``hidden``.
        labels: ``[..., T]`` integer ids in ``[0, V)``; no shift is applied.
        temperature: > 0, the sampling temperature; logits are divided by it.
        chunk_size: tokens per chunk (> 0); peak extra memory is about ``chunk_size * V``
            floats.
        lm_head_bias: optional ``[V]``.
        with_entropy: also return the entropy of each token's distribution.
        checked: False skips the argument checks and the host read that names labels outside
            ``[0, V)`` and positions whose logits are all ``-inf`` (NaN log-probs there): for
            a caller that scores many chunks of one checked batch with one head (the models'
            scoring sink checks its first chunk only).

    Returns:
        :class:`TokenStats` with ``[..., T]`` float32 tensors (float64 for float64 inputs),
        differentiable w.r.t. ``hidden``, ``lm_head_weight`` and ``lm_head_bias``.
    """
    if not isinstance(with_entropy, bool):
        raise TypeError(
            f"with_entropy must be a bool, got {type(with_entropy).__name__}; pass True or False"
        )
    return _stats_from_hidden(
        hidden, lm_head_weight, lm_head_bias, labels, temperature, chunk_size, with_entropy, checked
    )


def token_logprobs_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    lm_head_bias: Tensor | None = None,
) -> Tensor:
    """``[..., T]`` label log-probs from hidden states; see :func:`token_stats_from_hidden`."""
    return _stats_from_hidden(
        hidden, lm_head_weight, lm_head_bias, labels, temperature, chunk_size, False
    ).log_probs


def token_entropy_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    lm_head_bias: Tensor | None = None,
) -> Tensor:
    """``[..., T]`` entropies from hidden states without labels or full logits.

    Same arguments and guarantees as :func:`token_stats_from_hidden`.
    """
    return _stats_from_hidden(
        hidden, lm_head_weight, lm_head_bias, None, temperature, chunk_size, True
    ).entropy


_CDF_BLOCK = 256  # vocabulary entries per block of the two-level inversion


def invert_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """The index of each row of ``probs`` whose cumulative mass first exceeds ``u`` times the row's total.

    Two levels, both summed in float64: the block (``_CDF_BLOCK`` entries) whose cumulative mass first
    exceeds the point, then the entry inside it. An entry of probability 0 is never returned: the
    cumulative mass does not grow there, and rounding at a block's or row's end is held back to its
    last entry with mass.

    Args:
        probs: ``[b, V]`` non-negative, each row with some mass (any scale).
        u: ``float64 [b]`` points in ``[0, 1)``.

    Returns:
        ``long [b]`` indices, drawn from ``probs`` when ``u`` is uniform.
    """
    rows, vocab = probs.shape
    width = min(_CDF_BLOCK, vocab)
    count = -(-vocab // width)
    blocks = torch.nn.functional.pad(probs, (0, count * width - vocab)).view(rows, count, width)
    mass = blocks.sum(-1, dtype=torch.float64)
    cdf = mass.cumsum(-1)
    point = u.to(torch.float64)[:, None] * cdf[:, -1:]  # < the total: (1 - 2^-53) t rounds below t
    block = torch.minimum(torch.searchsorted(cdf, point, right=True), torch.searchsorted(cdf, cdf[:, -1:].contiguous()))
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp_min(0)), torch.zeros_like(point))
    inner = blocks.gather(1, block[:, :, None].expand(rows, 1, width)).squeeze(1).to(torch.float64).cumsum(-1)
    entry = torch.searchsorted(inner, point - before, right=True)
    entry = torch.minimum(entry, torch.searchsorted(inner, inner[:, -1:].contiguous()))
    return (block * width + entry).squeeze(-1)


def draw_categorical(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One index per row of ``probs [b, V]``, drawn from it: ``invert_cdf`` at one uniform per row.

    The law of ``torch.multinomial(probs, 1)``, which draws an exponential for every entry of the
    vocabulary instead (measured in docs/performance.md). ``long [b]``.
    """
    u = torch.rand(probs.shape[0], dtype=torch.float64, generator=generator, device=probs.device)
    return invert_cdf(probs, u)
