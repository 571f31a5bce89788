"""Chunk kernels behind the vocabulary reductions of ``logprobs.py`` and ``exact_kl.py``.

Everything here works on one chunk of ``C`` tokens at a time, in reusable ``[C, V]``
buffers, mostly in place: the memory bound of the public functions (about ``chunk_size * V``
extra floats) is exactly the size of these buffers. ``z`` always denotes a chunk of
temperature-scaled logits in the compute dtype (float32, or float64 for float64 inputs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from tether.ops.masks import row_slices


def shift_max_(z: Tensor) -> Tensor:
    """Subtract each row's max from ``z`` in place and return the shift ``[C, 1]``.

    After the shift every entry is ``<= 0``, so ``exp`` cannot overflow. A row whose
    logits are all ``-inf`` is shifted by 0 instead of by its max (``-inf - -inf`` is NaN):
    it stays all ``-inf``, its ``exp`` sums to 0 and its log-sum-exp is ``-inf``, which is
    how callers recognise a position without any distribution.
    """
    shift = z.amax(dim=-1, keepdim=True)
    shift.masked_fill_(shift == float("-inf"), 0.0)
    z.sub_(shift)
    return shift


def chunk_forward(
    z: Tensor, labels: Tensor | None, spare: Tensor | None
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """Label log-probs ``[C]`` (or None), log-sum-exp ``[C]`` and entropy ``[C]`` (or None).

    Overwrites ``z``. The entropy is computed only when a ``spare`` buffer shaped like ``z``
    is given. Working in place keeps the peak at one (two with entropy) chunk buffers;
    ``torch.logsumexp`` would allocate a hidden temporary of the chunk's size.
    """
    label_logit = None if labels is None else z.gather(-1, labels[:, None]).squeeze(-1)
    shift = shift_max_(z).squeeze(-1)
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


def chunk_grad(
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
    ``g_ent`` is given. A row without any finite logit (``lse = -inf``) has a NaN value and
    gets a zero gradient, so that masking it out downstream leaves the other rows' gradients
    finite.
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
    return grad.masked_fill_(lse[:, None] == float("-inf"), 0.0)


def load_logits(logits: Tensor, temperature: float, out: Tensor) -> Tensor:
    """``logits / temperature`` upcast into the scratch buffer ``out``."""
    out.copy_(logits)
    if temperature != 1.0:
        out.div_(temperature)
    return out


def head_logits(
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
    (and its page faults on CPU) for every chunk. When no upcast is needed the temperature
    rides on the GEMM's ``alpha`` / ``beta`` instead of costing another pass over ``out``.
    """
    scale = 1.0 / temperature
    if hidden.dtype == out.dtype and bias is None:
        # beta=0 makes the GEMM ignore the (uninitialised) contents of ``out``.
        return torch.addmm(out, hidden, weight.t(), beta=0.0, alpha=scale, out=out)
    if hidden.dtype == out.dtype:
        return torch.addmm(bias, hidden, weight.t(), beta=scale, alpha=scale, out=out)
    out.copy_(F.linear(hidden, weight, bias))
    if temperature != 1.0:
        out.div_(temperature)
    return out


def head_log_softmax(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    temperature: float,
    lse: Tensor,
    out: Tensor,
) -> Tensor:
    """``head_logits(...) - lse[:, None]`` in ``out``, i.e. the log-softmax of the chunk.

    Without bias or upcast, the subtraction is the GEMM's broadcast ``input`` term, which
    saves a pass over the ``[C, V]`` buffer in the backward's hot loop.
    """
    if hidden.dtype == out.dtype and bias is None:
        return torch.addmm(-lse[:, None], hidden, weight.t(), alpha=1.0 / temperature, out=out)
    return head_logits(hidden, weight, bias, temperature, out).sub_(lse[:, None])


def grad_scale(g: Tensor | None, temperature: float, dtype: torch.dtype) -> Tensor | None:
    """Upstream gradient in the compute dtype with the chain-rule factor ``1/temperature``."""
    return None if g is None else g.to(dtype) / temperature


def rows_of(t: Tensor | None, start: int, stop: int) -> Tensor | None:
    return None if t is None else t[start:stop]


class Scratch:
    """Chunk buffers ``[C, V]`` reused across chunks: one, plus a spare for entropy terms.

    Large CPU allocations are served by fresh ``mmap`` calls, so allocating per chunk would
    pay page faults on every chunk; one buffer per pass pays them once.
    """

    def __init__(self, rows: int, vocab: int, like: Tensor, dtype: torch.dtype, spare: bool):
        self.main = like.new_empty(rows, vocab, dtype=dtype)
        self.spare = torch.empty_like(self.main) if spare else None

    def take(self, rows: int) -> tuple[Tensor, Tensor | None]:
        return self.main[:rows], rows_of(self.spare, 0, rows)


# ``load(start, stop, out)`` writes the temperature-scaled logits of rows ``start:stop`` into
# ``out`` and returns it; it is the only thing that differs between the logits and the
# hidden-state paths.
LoadChunk = Callable[[int, int, Tensor], Tensor]


def stats_forward(
    load: LoadChunk,
    like: Tensor,
    n: int,
    vocab: int,
    dtype: torch.dtype,
    chunk_size: int,
    labels: Tensor | None,
    want_entropy: bool,
) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """Per-row label log-probs, log-sum-exp and entropy ``[N]``, one chunk at a time."""
    lse = like.new_empty(n, dtype=dtype)
    log_probs = None if labels is None else torch.empty_like(lse)
    entropy = torch.empty_like(lse) if want_entropy else None
    scratch = Scratch(min(chunk_size, n), vocab, like, dtype, spare=want_entropy)
    for start, stop in row_slices(n, chunk_size):
        z, spare = scratch.take(stop - start)
        c_lp, c_lse, c_ent = chunk_forward(
            load(start, stop, z), rows_of(labels, start, stop), spare
        )
        lse[start:stop] = c_lse
        if log_probs is not None:
            log_probs[start:stop] = c_lp
        if entropy is not None:
            entropy[start:stop] = c_ent
    return log_probs, lse, entropy


def stats_backward(
    load: LoadChunk,
    consume: Callable[[slice, Tensor], None],
    like: Tensor,
    vocab: int,
    chunk_size: int,
    saved: tuple[Tensor, Tensor | None, Tensor | None],
    g_lp: Tensor | None,
    g_ent: Tensor | None,
    temperature: float,
) -> None:
    """Recompute each chunk, form its logit gradient and hand it to ``consume(rows, grad)``."""
    lse, entropy, labels = saved
    n = lse.shape[0]
    g_lp = grad_scale(g_lp, temperature, lse.dtype)
    g_ent = grad_scale(g_ent, temperature, lse.dtype)
    scratch = Scratch(min(chunk_size, n), vocab, like, lse.dtype, spare=g_ent is not None)
    for start, stop in row_slices(n, chunk_size):
        z, spare = scratch.take(stop - start)
        rows = slice(start, stop)
        grad_z = chunk_grad(
            load(start, stop, z),
            lse[rows],
            rows_of(entropy, start, stop),
            rows_of(labels, start, stop),
            rows_of(g_lp, start, stop),
            rows_of(g_ent, start, stop),
            spare,
        )
        consume(rows, grad_z)


def label_grad_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    lse: Tensor,
    g_lp: Tensor,
    temperature: float,
    chunk_size: int,
    grads: HeadGrads,
) -> None:
    """Backward of label log-probs alone (no entropy), through the ``lm_head``.

    The RL hot path: per chunk one GEMM recomputes ``log p``, one in-place ``exp`` turns it
    into ``p``, and :meth:`HeadGrads.accumulate_label_grad` consumes ``p`` directly.
    """
    n = hidden.shape[0]
    g = grad_scale(g_lp, temperature, lse.dtype)
    scratch = Scratch(min(chunk_size, n), weight.shape[0], hidden, lse.dtype, spare=False)
    for start, stop in row_slices(n, chunk_size):
        rows = slice(start, stop)
        out, _ = scratch.take(stop - start)
        p = head_log_softmax(hidden[rows], weight, bias, temperature, lse[rows], out).exp_()
        grads.accumulate_label_grad(rows, p, labels[rows], g[rows])


def first_order_only(backward):
    """Refuse ``create_graph=True`` loudly instead of returning a silently wrong graph.

    The hand-written backwards of the chunked functions are not themselves differentiable;
    a second derivative through them would miss terms, so asking for one raises.
    """

    @functools.wraps(backward)
    def checked(ctx, *grads):
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "tether's chunked log-prob / KL functions have a first-order custom "
                "backward; create_graph=True (double backward, Hessian-vector products) is "
                "not supported. Use the naive full-logit computation for higher derivatives."
            )
        return backward(ctx, *grads)

    return checked


class HeadGrads:
    """Accumulates gradients of ``hidden @ weight.T + bias`` chunk by chunk.

    ``grad_z`` per chunk is already the gradient w.r.t. the raw (unscaled) logits. Weight
    and bias gradients sum over all chunks, so they accumulate in the compute dtype and are
    cast to the parameter dtype once at the end; a bf16 running sum would lose the small
    contributions of later chunks.
    """

    def __init__(self, hidden, weight, bias, need_h, need_w, need_b, dtype):
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.grad_h = torch.empty_like(hidden) if need_h else None
        self.grad_w = (
            torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        )
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

    def accumulate_label_grad(self, rows: slice, p: Tensor, labels: Tensor, g: Tensor) -> None:
        """Same as ``accumulate(rows, g[:, None] * (onehot(labels) - p))`` without forming it.

        ``p`` becomes ``p - onehot(labels)`` in place (``C`` writes), and because ``g`` is
        per row it is applied on the small ``[C, H]`` side of each GEMM:
        ``grad_h = -g * ((p - onehot) @ W)``, ``grad_W -= (p - onehot).T @ (g * h)``.
        The only passes over the ``[C, V]`` buffer are then the GEMMs that read it.
        """
        weight = self.weight
        p.scatter_add_(1, labels[:, None], p.new_full((p.shape[0], 1), -1.0))
        if self.grad_h is not None:
            p_w = torch.mm(p if p.dtype == weight.dtype else p.to(weight.dtype), weight)
            self.grad_h[rows] = p_w.mul_(-g[:, None].to(p_w.dtype))
        if self.grad_w is not None:
            scaled = self.hidden[rows].to(p.dtype) * g[:, None]
            self.grad_w.addmm_(p.t(), scaled, alpha=-1.0)
        if self.grad_b is not None:
            self.grad_b.addmv_(p.t(), g, alpha=-1.0)

    def result(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        grad_w = None if self.grad_w is None else self.grad_w.to(self.weight.dtype)
        grad_b = None if self.grad_b is None else self.grad_b.to(self.bias.dtype)
        return self.grad_h, grad_w, grad_b
