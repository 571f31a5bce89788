"""Where scoring ends: hidden states at batch positions become per-token values on the grid.

Every scoring path of ``tether.models.scoring`` (packed passes, right-padded micro-batches,
the shared-prefix split) runs a decoder and hands each chunk of last hidden states to one
``TokenSink`` together with the labels they predict and their flat ``row * T + col``
positions. The sink is the only place that

* narrows the work to the positions asked for (``where``): the output head, the softmaxes
  and everything vocabulary-wide run there only, since an answer's log-probs need nothing
  at the prompt's positions;
* keeps the hidden states at those positions (``keep_hidden``), in the row-major order of
  ``where``, as a ``HeadHidden`` record: what a reference pass hands to the policy's loss
  pass so the exact KL costs two head projections instead of two more decoder passes;
* computes that exact KL (``kl_to``), never with a gradient;
* scatters the values back to ``[B, T]`` once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from tether.models.score_plan import scatter_tokens
from tether.ops import TokenStats, exact_kl_from_hidden, token_stats_from_hidden
from tether.ops._vocab_checks import compute_dtype

# Largest vocabulary-wide scratch (chunk_size x V) the head uses on a CPU when the caller sets
# no chunk size. glibc hands an allocation above 32 MiB (its largest mmap threshold) fresh
# pages and unmaps it on free; with the ops' 1024-token default (192 MiB for a 49k
# vocabulary) every pass paged hundreds of MiB back in: 0.1-0.45 M minor faults and 10-15 %
# of a reference pass of the embedded model, against none under this cap (benchmarks/scoring.py).
CPU_HEAD_SCRATCH_BYTES = 24 << 20


def default_chunk_size(head_weight: Tensor) -> int | None:
    """Tokens per head chunk when the caller gives none: the scratch cap on a CPU, the ops' default elsewhere."""
    if head_weight.device.type != "cpu":
        return None
    itemsize = torch.finfo(compute_dtype(head_weight.dtype)).bits // 8
    return max(16, CPU_HEAD_SCRATCH_BYTES // (head_weight.shape[0] * itemsize))


@dataclass(frozen=True)
class HeadHidden:
    """A model's last hidden states at chosen positions of a batch, and its output head.

    Attributes:
        hidden: ``[N, H]``, one row per position of the scoring call's ``where`` mask, in
            row-major order (row by row, left to right). Detached.
        weight: ``[V, H]`` head weight. bias: ``[V]`` or None.
    """

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None = None

    def rows(self, where: Tensor, begin: int, end: int) -> HeadHidden:
        """The part belonging to rows ``begin:end`` of the batch whose ``where [B, T]`` made it."""
        counts = where.sum(-1)
        first = int(counts[:begin].sum())
        return HeadHidden(self.hidden[first : first + int(counts[begin:end].sum())], self.weight, self.bias)

    def take(self, where: Tensor, index: Tensor) -> HeadHidden:
        """The parts belonging to rows ``index`` (``long [N]``, any order) of the batch whose ``where``
        made it, in that order."""
        counts = where.sum(-1).to(self.hidden.device)
        index = index.to(counts.device)
        starts, picked = counts.cumsum(0) - counts, counts[index]
        out_starts = picked.cumsum(0) - picked
        source = torch.arange(int(picked.sum()), device=counts.device) + torch.repeat_interleave(
            starts[index] - out_starts, picked)
        return HeadHidden(self.hidden[source], self.weight, self.bias)

    @staticmethod
    def cat(parts: list[HeadHidden]) -> HeadHidden:
        """Several batches' hidden states, rows stacked in order; one output head for all."""
        head = parts[0]
        if any(not (p.weight is head.weight or torch.equal(p.weight, head.weight)) for p in parts[1:]):
            raise ValueError("HeadHidden.cat: the parts were kept with different output heads; join hidden "
                             "states of one model and step only.")
        return HeadHidden(torch.cat([p.hidden for p in parts]), head.weight, head.bias)


@dataclass(frozen=True)
class ScoredTokens(TokenStats):
    """``TokenStats`` plus what a scoring call was asked to keep or compare.

    Attributes:
        log_probs: as ``TokenStats``; None when the call passed ``log_probs=False``.
        hidden: the model's hidden states at ``where`` (``keep_hidden=True``), else None.
        exact_kl: ``[B, T]`` full-vocabulary ``KL(model || other)`` at ``where`` against the
            ``kl_to`` hidden states (0 elsewhere, no gradient), else None.
    """

    log_probs: Tensor | None  # None when the call was asked for no log-probs (``log_probs=False``)
    hidden: HeadHidden | None = None
    exact_kl: Tensor | None = None


class Scorer(Protocol):
    """What a loss needs of its policy: per-token log-probs (and entropy) of a batch.

    The short form is ``score(tokens, attention_mask, *, with_entropy) -> TokenStats``. A scorer
    that also takes ``where=`` (score only those positions) and ``kl_to=`` (the exact KL against
    another model's kept hidden states), as ``TransformersWrapper`` does, says so with
    ``scores_positions = True``; callers read that flag, never the scorer's type.
    """

    scores_positions: bool

    def score(self, tokens: Tensor, attention_mask: Tensor, *, with_entropy: bool = False,
              **positions: Any) -> TokenStats: ...


def scores_positions(scorer: object) -> bool:
    """Whether ``scorer.score`` takes ``where=`` and ``kl_to=`` (``Scorer``'s full form)."""
    return bool(getattr(scorer, "scores_positions", False))


def check_where(where: Tensor | None, tokens: Tensor) -> None:
    """``where`` must be None or a bool mask of the tokens' shape.

    Positions without a prediction (padding, each row's first token) are 0 whatever
    ``where`` says; ``keep_hidden`` and ``kl_to`` count positions, so there ``TokenSink``
    refuses a ``where`` that marks any.
    """
    if where is not None and (where.shape != tokens.shape or where.dtype != torch.bool):
        raise ValueError(
            f"where: expected a bool mask of the tokens' shape {tuple(tokens.shape)}, got "
            f"{where.dtype} {tuple(where.shape)}. Pass e.g. the assistant mask, or None for every position."
        )


class TokenSink:
    """Collects one scoring call's chunks and turns them into a ``ScoredTokens`` (see module doc)."""

    def __init__(self, head: nn.Module, shape: tuple[int, int], *, where: Tensor | None, temperature: float,
                 chunk_size: int | None, with_entropy: bool, keep_hidden: bool = False,
                 kl_to: HeadHidden | None = None, log_probs: bool = True) -> None:
        self.head, self.shape = head, shape
        device = head.weight.device
        self.where = None if where is None else where.reshape(-1).to(device)
        self.wanted = None if where is None else int(self.where.sum())
        if (keep_hidden or kl_to is not None) and where is None:
            raise ValueError("where: keep_hidden and kl_to need the positions they refer to; pass where (e.g. the "
                             "assistant mask).")
        if kl_to is not None and kl_to.hidden.shape[0] != self.wanted:
            raise ValueError(
                f"kl_to: holds hidden states of {kl_to.hidden.shape[0]} positions but where marks {self.wanted}; "
                "pass the HeadHidden kept by a scoring call with the same tokens and where."
            )
        self.rank = None if where is None else self.where.long().cumsum(0) - 1
        chunk_size = default_chunk_size(head.weight) if chunk_size is None else chunk_size
        self.kwargs = {"temperature": temperature, **({} if chunk_size is None else {"chunk_size": chunk_size})}
        if not log_probs and (with_entropy or kl_to is None):
            raise ValueError("log_probs=False: a scoring call without log-probs computes only the exact KL; pass "
                             "kl_to (and no with_entropy), or keep log_probs=True.")
        self.with_entropy, self.keep_hidden, self.kl_to = with_entropy, keep_hidden, kl_to
        self.with_log_probs = log_probs
        self.index: list[Tensor] = []
        self.log_probs: list[Tensor] = []
        self.entropy: list[Tensor] = []
        self.kept: list[Tensor] = []
        self.kl: list[Tensor] = []

    def chosen(self, flat_index: Tensor) -> Tensor | None:
        """``bool [n]``: which of these positions are wanted (None: all of them)."""
        return None if self.where is None else self.where[flat_index]

    def add(self, hidden: Tensor, labels: Tensor, flat_index: Tensor) -> None:
        """Score ``hidden [n, H]`` predicting ``labels [n]`` at batch positions ``flat_index [n]``."""
        chosen = self.chosen(flat_index)
        if chosen is not None:
            hidden, labels, flat_index = hidden[chosen], labels[chosen], flat_index[chosen]
        head = self.head
        if self.with_log_probs:
            self._append(token_stats_from_hidden(hidden, head.weight, labels, lm_head_bias=getattr(head, "bias", None),
                                                 with_entropy=self.with_entropy, **self.kwargs), flat_index)
        else:
            self.index.append(flat_index)
        if self.keep_hidden:
            self.kept.append(hidden.detach())
        if self.kl_to is not None:
            with torch.no_grad():
                ref = self.kl_to
                self.kl.append(exact_kl_from_hidden(
                    hidden.detach(), head.weight, ref.hidden[self.rank[flat_index]], ref.weight,
                    lm_head_bias=getattr(head, "bias", None), ref_lm_head_bias=ref.bias, **self.kwargs,
                ))

    def add_values(self, stats: TokenStats, flat_index: Tensor) -> None:
        """Values already computed (``[n]`` each) for positions ``flat_index [n]``; those outside
        ``where`` are dropped here (a model without a linear head has no hidden states to narrow)."""
        chosen = self.chosen(flat_index)
        if chosen is not None:
            flat_index = flat_index[chosen]
            stats = TokenStats(stats.log_probs[chosen], None if stats.entropy is None else stats.entropy[chosen])
        self._append(stats, flat_index)

    def _append(self, stats: TokenStats, flat_index: Tensor) -> None:
        self.index.append(flat_index)
        self.log_probs.append(stats.log_probs)
        if self.with_entropy:
            self.entropy.append(stats.entropy)

    def result(self) -> ScoredTokens:
        batch, width = self.shape
        device = self.head.weight.device
        grid = lambda values: scatter_tokens(self.index, values, batch, width, device)  # noqa: E731
        hidden = None
        if self.keep_hidden:
            order = torch.argsort(torch.cat(self.index)) if self.index else torch.zeros(0, dtype=torch.long)
            rows = torch.cat(self.kept)[order] if self.kept else self.head.weight.new_zeros(0, self.head.weight.shape[1])
            if rows.shape[0] != self.wanted:
                raise ValueError(
                    f"where: marks {self.wanted} positions but {rows.shape[0]} of them are scored; padding and the "
                    "first token of a row have no prediction. Pass where & attention_mask without each row's first token."
                )
            hidden = HeadHidden(rows, self.head.weight.detach(), _detached(getattr(self.head, "bias", None)))
        return ScoredTokens(
            log_probs=grid(self.log_probs) if self.with_log_probs else None,
            entropy=grid(self.entropy) if self.with_entropy else None,
            hidden=hidden,
            exact_kl=grid(self.kl) if self.kl_to is not None else None,
        )


def _detached(bias: Tensor | None) -> Tensor | None:
    return None if bias is None else bias.detach()
