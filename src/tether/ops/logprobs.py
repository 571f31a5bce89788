"""Per-token label log-probabilities and entropies over the vocabulary, chunked over tokens.

Reductions over the vocabulary run in float32 whatever the model dtype (float64 stays
float64). Tokens are processed ``chunk_size`` at a time and every backward pass recomputes
its chunk instead of reading saved activations, so no float32 ``[..., T, V]`` tensor for all
tokens ever exists. The ``*_from_hidden`` variants also fold in the ``lm_head`` projection:
they never build the full logits in any dtype, which for a vocabulary of 50k-150k is where
most of the memory of a naive ``lm_head`` + ``log_softmax`` + ``gather`` goes.

The one host synchronisation is the range check on ``labels``: an out-of-range id would
otherwise surface as an opaque index error (or a device-side assert on GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from tether.ops._vocab_checks import (
    check_chunk_size,
    check_head,
    check_labels,
    check_logits,
    check_temperature,
    chunk_bounds,
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
# Per-chunk math shared by the logits and hidden-state paths. ``z`` is always a chunk of
# already temperature-scaled logits ``[C, V]`` in the compute dtype.


def _shift_max_(z: Tensor) -> Tensor:
    """Subtract each row's max from ``z`` in place and return the max ``[C, 1]``.

    A row whose logits are all ``-inf`` keeps a shift of 0 so that it becomes all ``-inf``
    (log-sum-exp ``-inf``) instead of all NaN.
    """
    shift = z.amax(dim=-1, keepdim=True)
    shift.masked_fill_(shift == float("-inf"), 0.0)
    z.sub_(shift)
    return shift


def _chunk_forward(
    z: Tensor, labels: Tensor | None, spare: Tensor | None
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """Label log-probs ``[C]`` (or None), log-sum-exp ``[C]`` and entropy ``[C]`` (or None).

    Overwrites ``z``. The entropy is computed only when a ``spare`` buffer shaped like ``z``
    is given. Working in place keeps the peak at one (two with entropy) chunk buffers;
    ``torch.logsumexp`` would allocate a hidden temporary of the chunk's size.
    """
    label_logit = None if labels is None else z.gather(-1, labels[:, None]).squeeze(-1)
    shift = _shift_max_(z).squeeze(-1)
    entropy = None
    if spare is None:
        total = z.exp_().sum(-1)
    else:
        # With z' = z - max and s = sum exp(z'): H = log s - sum(exp(z') z') / s. Entries
        # with exp(z') == 0 (z' = -inf) contribute 0, not 0 * -inf = NaN.
        e = torch.exp(z, out=spare)
        total = e.sum(-1)
        weighted = e.mul_(z).masked_fill_(z == float("-inf"), 0.0).sum(-1)
        entropy = total.log() - weighted / total
    lse = shift + total.log()
    log_probs = None if label_logit is None else label_logit - lse
    return log_probs, lse, entropy


def _chunk_grad(
    z: Tensor,
    lse: Tensor,
    entropy: Tensor | None,
    labels: Tensor | None,
    g_lp: Tensor | None,
    g_ent: Tensor | None,
    spare: Tensor | None,
) -> Tensor:
    """Gradient w.r.t. ``z`` of ``sum(g_lp * log_probs + g_ent * entropy)`` over the chunk.

    With ``p = softmax(z)`` and ``log p = z - lse``:
    ``d log p_y / dz = onehot(y) - p`` and, since ``H = -sum p log p = lse - sum p z``,
    ``dH/dz_j = -p_j (z_j - sum_i p_i z_i) = -p_j (log p_j + H)``.
    Overwrites ``z`` and returns it; ``spare`` (shaped like ``z``) is needed when
    ``g_ent`` is given.
    """
    logp = z.sub_(lse[:, None])
    if g_ent is None:
        grad = logp.exp_().mul_(-g_lp[:, None])
    else:
        p = torch.exp(logp, out=spare)
        coef = logp.add_(entropy[:, None]).mul_(g_ent[:, None])
        if g_lp is not None:
            coef.add_(g_lp[:, None])
        # Where p == 0 the bracket may be -inf or NaN (log p = -inf); the true term is 0.
        grad = coef.mul_(p).neg_().masked_fill_(p == 0, 0.0)
    if g_lp is not None:
        grad.scatter_add_(1, labels[:, None], g_lp[:, None])
    return grad


def _load_logits(logits: Tensor, temperature: float, out: Tensor) -> Tensor:
    """``logits / temperature`` upcast into the scratch buffer ``out``."""
    out.copy_(logits)
    if temperature != 1.0:
        out.div_(temperature)
    return out


def _head_logits(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    temperature: float,
    out: Tensor,
) -> Tensor:
    """``(hidden @ weight.T + bias) / temperature`` written into ``out`` ``[C, V]``.

    The projection runs in the model dtype, as the model's own ``lm_head`` would, and the
    result is then upcast: a bf16 model therefore gives the same logits here as a naive
    ``lm_head(hidden).float()``. Reusing one ``out`` buffer avoids a fresh large allocation
    (and its page faults on CPU) for every chunk.
    """
    if hidden.dtype == out.dtype and bias is None:
        torch.mm(hidden, weight.t(), out=out)
    elif hidden.dtype == out.dtype:
        torch.addmm(bias, hidden, weight.t(), out=out)
    else:
        out.copy_(F.linear(hidden, weight, bias))
    if temperature != 1.0:
        out.div_(temperature)
    return out


def _grad_scale(g: Tensor | None, temperature: float, dtype: torch.dtype) -> Tensor | None:
    """Upstream gradient in the compute dtype with the chain-rule factor ``1/temperature``."""
    return None if g is None else g.to(dtype) / temperature


def _slice(t: Tensor | None, start: int, stop: int) -> Tensor | None:
    return None if t is None else t[start:stop]


class _Scratch:
    """Chunk buffers ``[C, V]`` reused across chunks: one, plus a spare for entropy terms.

    Large CPU allocations are served by fresh ``mmap`` calls, so allocating per chunk would
    pay page faults on every chunk; one buffer per pass pays them once.
    """

    def __init__(self, rows: int, vocab: int, like: Tensor, dtype: torch.dtype, spare: bool):
        self.main = like.new_empty(rows, vocab, dtype=dtype)
        self.spare = torch.empty_like(self.main) if spare else None

    def take(self, rows: int) -> tuple[Tensor, Tensor | None]:
        return self.main[:rows], _slice(self.spare, 0, rows)


# ``load(start, stop, out)`` writes the temperature-scaled logits of rows ``start:stop`` into
# ``out`` and returns it; it is the only thing that differs between the logits and the
# hidden-state paths.
LoadChunk = Callable[[int, int, Tensor], Tensor]


def _stats_forward(
    load: LoadChunk, like: Tensor, n: int, vocab: int, dtype: torch.dtype,
    chunk_size: int, labels: Tensor | None, want_entropy: bool,
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """Per-row label log-probs, log-sum-exp and entropy ``[N]``, one chunk at a time."""
    lse = like.new_empty(n, dtype=dtype)
    log_probs = None if labels is None else torch.empty_like(lse)
    entropy = torch.empty_like(lse) if want_entropy else None
    scratch = _Scratch(min(chunk_size, n), vocab, like, dtype, spare=want_entropy)
    for start, stop in chunk_bounds(n, chunk_size):
        z, spare = scratch.take(stop - start)
        c_lp, c_lse, c_ent = _chunk_forward(
            load(start, stop, z), _slice(labels, start, stop), spare
        )
        lse[start:stop] = c_lse
        if log_probs is not None:
            log_probs[start:stop] = c_lp
        if entropy is not None:
            entropy[start:stop] = c_ent
    return log_probs, lse, entropy


def _stats_backward(
    load: LoadChunk, consume: Callable[[slice, Tensor], None], like: Tensor, vocab: int,
    chunk_size: int, saved: tuple[Tensor, Tensor | None, Tensor | None],
    g_lp: Tensor | None, g_ent: Tensor | None, temperature: float,
) -> None:
    """Recompute each chunk, form its logit gradient and hand it to ``consume(rows, grad)``."""
    lse, entropy, labels = saved
    n = lse.shape[0]
    g_lp = _grad_scale(g_lp, temperature, lse.dtype)
    g_ent = _grad_scale(g_ent, temperature, lse.dtype)
    scratch = _Scratch(min(chunk_size, n), vocab, like, lse.dtype, spare=g_ent is not None)
    for start, stop in chunk_bounds(n, chunk_size):
        z, spare = scratch.take(stop - start)
        rows = slice(start, stop)
        grad_z = _chunk_grad(
            load(start, stop, z), lse[rows], _slice(entropy, start, stop),
            _slice(labels, start, stop), _slice(g_lp, start, stop),
            _slice(g_ent, start, stop), spare,
        )
        consume(rows, grad_z)


# ---------------------------------------------------------------------------------------
# Autograd functions. Inputs are flattened to ``[N, V]`` / ``[N, H]``; outputs are ``[N]``.


class _LogitsStats(torch.autograd.Function):
    """Label log-probs and/or entropy from full logits, saving only logits and ``[N]`` rows."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size, want_entropy):
        def load(start, stop, out):
            return _load_logits(logits[start:stop], temperature, out)

        n, vocab = logits.shape
        log_probs, lse, entropy = _stats_forward(
            load, logits, n, vocab, compute_dtype(logits.dtype), chunk_size, labels, want_entropy
        )
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        logits, labels, lse, entropy = ctx.saved_tensors
        if (g_lp is None and g_ent is None) or not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        temperature = ctx.temperature

        def load(start, stop, out):
            return _load_logits(logits[start:stop], temperature, out)

        # The gradient itself is [N, V] in the logits dtype; only the float32 work is chunked.
        grad = torch.empty_like(logits)

        def consume(rows, grad_z):
            grad[rows] = grad_z

        _stats_backward(
            load, consume, logits, logits.shape[1], ctx.chunk_size,
            (lse, entropy, labels), g_lp, g_ent, temperature,
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
            return _head_logits(hidden[start:stop], weight, bias, temperature, out)

        log_probs, lse, entropy = _stats_forward(
            load, hidden, hidden.shape[0], weight.shape[0], compute_dtype(hidden.dtype),
            chunk_size, labels, want_entropy,
        )
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (g_lp is None and g_ent is None) or not (need_h or need_w or need_b):
            return None, None, None, None, None, None, None
        temperature = ctx.temperature

        def load(start, stop, out):
            return _head_logits(hidden[start:stop], weight, bias, temperature, out)

        grads = _HeadGrads(hidden, weight, bias, need_h, need_w, need_b, lse.dtype)
        _stats_backward(
            load, grads.accumulate, hidden, weight.shape[0], ctx.chunk_size,
            (lse, entropy, labels), g_lp, g_ent, temperature,
        )
        return (*grads.result(), None, None, None, None)


class _HeadGrads:
    """Accumulates gradients of ``hidden @ weight.T + bias`` chunk by chunk.

    ``grad_z`` per chunk is already the gradient w.r.t. the raw (unscaled) logits. Weight
    and bias gradients sum over all chunks, so they accumulate in the compute dtype and are
    cast to the parameter dtype once at the end; a bf16 running sum would lose the small
    contributions of later chunks.
    """

    def __init__(self, hidden, weight, bias, need_h, need_w, need_b, dtype):
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.grad_h = torch.empty_like(hidden) if need_h else None
        self.grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        self.grad_b = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if need_b else None

    def accumulate(self, rows: slice, grad_z: Tensor) -> None:
        if self.grad_h is not None:
            if grad_z.dtype == self.weight.dtype:
                torch.mm(grad_z, self.weight, out=self.grad_h[rows])
            else:
                self.grad_h[rows] = grad_z.to(self.weight.dtype) @ self.weight
        if self.grad_w is not None:
            self.grad_w.addmm_(grad_z.t(), self.hidden[rows].to(grad_z.dtype))
        if self.grad_b is not None:
            self.grad_b += grad_z.sum(0)

    def result(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        grad_w = None if self.grad_w is None else self.grad_w.to(self.weight.dtype)
        grad_b = None if self.grad_b is None else self.grad_b.to(self.bias.dtype)
        return self.grad_h, grad_w, grad_b


# ---------------------------------------------------------------------------------------
# Public API.


def _stats_from_logits(logits, labels, temperature, chunk_size, want_entropy) -> TokenStats:
    temperature = check_temperature(temperature)
    chunk_size = check_chunk_size(chunk_size, allow_none=True)
    check_logits("logits", logits)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    flat_labels = None
    if labels is not None:
        flat_labels = check_labels(labels, lead, vocab, logits.device, "logits").reshape(-1)
    chunk = chunk_size if chunk_size is not None else max(lead.numel(), 1)
    log_probs, entropy = _LogitsStats.apply(
        logits.reshape(-1, vocab), flat_labels, temperature, chunk, want_entropy
    )
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
    """
    return _stats_from_logits(logits, labels, temperature, chunk_size, False).log_probs


def token_entropy(
    logits: Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> Tensor:
    """Entropy ``-sum_v p_v log p_v`` of ``p = softmax(logits / temperature)`` per token.

    ``logits`` ``[..., T, V]`` -> ``[..., T]`` float32 (float64 if ``logits`` are float64).
    Entries with a ``-inf`` logit contribute 0. Differentiable w.r.t. ``logits``.
    """
    return _stats_from_logits(logits, None, temperature, chunk_size, True).entropy


def _stats_from_hidden(
    hidden, weight, bias, labels, temperature, chunk_size, want_entropy
) -> TokenStats:
    temperature = check_temperature(temperature)
    chunk_size = check_chunk_size(chunk_size, allow_none=False)
    check_head(hidden, weight, bias, "hidden", "lm_head_weight", "lm_head_bias")
    lead, width, vocab = hidden.shape[:-1], hidden.shape[-1], weight.shape[0]
    flat_labels = None
    if labels is not None:
        flat_labels = check_labels(labels, lead, vocab, hidden.device, "hidden").reshape(-1)
    log_probs, entropy = _HiddenStats.apply(
        hidden.reshape(-1, width), weight, bias, flat_labels, temperature, chunk_size, want_entropy
    )
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

    Returns:
        :class:`TokenStats` with ``[..., T]`` float32 tensors (float64 for float64 inputs),
        differentiable w.r.t. ``hidden``, ``lm_head_weight`` and ``lm_head_bias``.
    """
    if not isinstance(with_entropy, bool):
        raise TypeError(
            f"with_entropy must be a bool, got {type(with_entropy).__name__}; "
            "pass True or False"
        )
    return _stats_from_hidden(
        hidden, lm_head_weight, lm_head_bias, labels, temperature, chunk_size, with_entropy
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
