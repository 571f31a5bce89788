"""A scoring pass's plan and sink: how a padded ``[B, T]`` batch is cut into forward passes, and
how the hidden states they return become per-token values on the batch's grid.

One planner serves every scorer (padding-free scoring, exact KL, the shared-prefix split's
passes, the sampler's prefill): rows go longest first so each pass's padded size stays under a
token budget, a pass is laid out right-padded (``tether.ops.masks.padded_index``), and values
come back through one flat scatter index; rows repeating a prefix are grouped by
``distinct_rows``. ``check_fits_model`` refuses ids past the embedding and rows past
``max_position_embeddings`` before the first pass (else a bare ``IndexError``, or silently
extrapolated rotary positions), reading both back in one transfer.

Every scoring path hands each chunk of last hidden states to one ``TokenSink`` with the labels
they predict and their flat ``row * T + col`` positions. The sink alone narrows the work to the
positions asked for (``where``: the head and the softmaxes run there only), keeps the hidden
states there as a ``HeadHidden`` (``keep_hidden``: the reference pass's gift to the loss pass,
so the exact KL costs two head projections, not two decoder passes), computes that exact KL
(``kl_to``, no gradient unless ``kl_grad``), and scatters the values back to ``[B, T]`` once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tether.models.records import HeadHidden, ScoredTokens
from tether.ops import TokenStats, exact_kl_from_hidden, token_stats_from_hidden
from tether.ops.checks import compute_dtype
from tether.ops.masks import padded_index, row_runs, row_slices  # row_slices: its callers import it from here


def row_spans(attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Start index and length of the single run of valid tokens of each row.

    Args:
        attention_mask: ``bool [B, T]``; each row must be one contiguous run (left, right or
            no padding).

    Returns:
        ``(start [B], length [B])``, both ``long``.
    """
    mask = attention_mask.bool()
    start, lengths = row_runs(mask)
    cols = torch.arange(mask.shape[-1], device=mask.device)
    rebuilt = (cols >= start[:, None]) & (cols < (start + lengths)[:, None])
    if not torch.equal(rebuilt, mask):
        bad = (rebuilt != mask).any(-1).nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask: expected each row to be one contiguous run of valid tokens "
            f"(left or right padding), but rows {bad[:8]} have holes. Remove the interior "
            "padding or score those rows separately."
        )
    return start, lengths


@dataclass(frozen=True)
class Spans:
    """A batch's rows checked once (``row_spans``), what every pass of one scoring call reads: ``mask
    bool [B, T]`` (each row one contiguous run), each run's ``start [B]`` and ``lengths [B]`` (long)."""

    mask: Tensor
    start: Tensor
    lengths: Tensor

    @classmethod
    def of(cls, attention_mask: Tensor) -> Spans:
        """Check ``attention_mask`` (``row_spans``'s error for a row with holes) and keep its runs."""
        mask = attention_mask.bool()
        return cls(mask, *row_spans(mask))

    def take(self, rows: Tensor) -> Spans:
        """The spans of rows ``rows`` (``long [r]``), in that order."""
        return Spans(self.mask[rows], self.start[rows], self.lengths[rows])

    def to(self, device: torch.device | str) -> Spans:
        return Spans(self.mask.to(device), self.start.to(device), self.lengths.to(device))


def plan_micro_batches(lengths: Tensor, token_budget: int, *, packed: bool = False) -> list[Tensor]:
    """Group row indices, longest first, so each group's size fits the budget.

    A group's size is ``rows * longest`` (right-padded) or, with ``packed``, the sum of its
    lengths (rows end to end). A row longer than the budget gets a group of its own. Returns
    index tensors whose concatenation is a permutation of ``range(B)``.
    """
    order = torch.argsort(lengths, descending=True, stable=True)
    sorted_lengths = lengths[order].tolist()
    groups: list[Tensor] = []
    begin = 0
    while begin < len(sorted_lengths):
        longest, end, used = max(sorted_lengths[begin], 1), begin + 1, sorted_lengths[begin]
        while end < len(sorted_lengths):
            size = used + sorted_lengths[end] if packed else (end - begin + 1) * longest
            if size > token_budget:
                break
            used, end = used + sorted_lengths[end], end + 1
        groups.append(order[begin:end])
        begin = end
    return groups


@dataclass(frozen=True)
class MicroBatch:
    """One right-padded micro-batch cut out of a ``[B, T]`` batch."""

    ids: Tensor  # long [b, L] on the model's device
    valid: Tensor  # bool [b, L] on the model's device
    flat_index: Tensor  # long [n]: row * T + column of each predicted token (t >= 1)
    keep: Tensor  # bool [b, L - 1]: which predicted positions are real tokens


def iter_micro_batches(tokens: Tensor, spans: Spans, token_budget: int, device) -> list[MicroBatch]:
    """Cut a padded batch (its rows' ``spans``) into length-sorted, right-padded micro-batches (see module doc)."""
    start, lengths = spans.start, spans.lengths
    width = tokens.shape[-1]
    flat = torch.cat([tokens.reshape(-1), tokens.new_zeros(1)])  # padding reads the appended 0
    out: list[MicroBatch] = []
    for rows in plan_micro_batches(lengths, token_budget):
        length = int(lengths[rows].max())
        if length < 2:
            continue  # a row of 0 or 1 token has no predicted token
        index, valid = padded_index(rows * width + start[rows], lengths[rows], length, fill_index=flat.numel() - 1)
        keep = valid[:, 1:]
        out.append(MicroBatch(flat[index].to(device), valid.to(device), index[:, 1:][keep].to(device), keep.to(device)))
    return out


def first_of_each(group: Tensor) -> Tensor:
    """Index of the first row holding each group id ``0..U-1`` of ``group [B]`` (``long [U]``)."""
    count = int(group.max()) + 1
    rows = torch.arange(group.numel(), device=group.device)
    first = torch.full((count,), group.numel(), dtype=torch.long, device=group.device)
    return first.scatter_reduce(0, group, rows, reduce="amin")


def distinct_rows(keyed: Tensor) -> tuple[Tensor, Tensor]:
    """``(first [U], inverse [B])``: one representative row per distinct row of ``keyed [B, P]``.

    ``inverse[b]`` is the distinct row of ``b`` and ``first[u]`` its first occurrence; mark
    padding with a value no token takes (e.g. -1) so it is part of the comparison.
    """
    _, inverse = torch.unique(keyed, dim=0, return_inverse=True)
    return first_of_each(inverse), inverse


def scatter_tokens(index: list[Tensor], values: list[Tensor], batch: int, width: int, device) -> Tensor:
    """Place flat per-token values at flat ``row * width + col`` positions of a zero grid."""
    if not values:
        return torch.zeros(batch, width, device=device)
    flat_values = torch.cat(values)
    flat_index = torch.cat(index).to(device)
    grid = flat_values.new_zeros(batch * width)
    return grid.index_put((flat_index,), flat_values).view(batch, width)


@dataclass(frozen=True)
class ModelLimits:
    """``vocab``: ids must lie in ``[0, vocab)``; ``max_positions``: longest sequence.

    Either is None when the model does not say (no embedding rows, no config entry).
    """

    name: str
    vocab: int | None
    max_positions: int | None


def _rows(module: object) -> int | None:
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, Tensor) and weight.dim() == 2 else None


def model_limits(model: nn.Module) -> ModelLimits:
    """The vocabulary (fewest rows of input and output embeddings) and position limit."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    sizes = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            sizes.append(_rows(getattr(inner, getter)()))
        except (AttributeError, NotImplementedError):
            continue  # a model that does not expose this embedding: nothing to check
    sizes = [s for s in sizes if s is not None]
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    limit = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None
    source = getattr(config, "name_or_path", "") or ""
    name = type(inner).__name__ + (f" ({source!r})" if source else "")
    return ModelLimits(name=name, vocab=min(sizes) if sizes else None, max_positions=limit)


def check_fits_model(
    model: nn.Module, ids: Tensor, mask: Tensor, *, new_tokens: int = 0, role: str = "tokens"
) -> None:
    """Refuse ids outside the model's vocabulary and rows longer than its positions.

    Args:
        model: the HF causal LM (or PEFT model / adapter-disabled reference) to be run.
        ids: ``long [B, T]`` token ids; only positions where ``mask`` is True are checked.
        mask: ``bool [B, T]`` valid tokens.
        new_tokens: tokens that sampling may append to every row (``max_new_tokens``).
        role: how the error names ``ids`` (e.g. ``"prompt_ids"``).
    """
    limits = model_limits(model)
    if ids.numel() == 0 or (limits.vocab is None and limits.max_positions is None):
        return
    mask = mask.bool()
    valid_ids = ids.masked_fill(~mask, 0)
    low, high, longest = torch.stack(
        [valid_ids.min(), valid_ids.max(), mask.sum(-1).max()]
    ).tolist()
    if limits.vocab is not None and (low < 0 or high >= limits.vocab):
        raise ValueError(
            f"{role}: ids must lie in [0, {limits.vocab}), the vocabulary of {limits.name} "
            f"({limits.vocab} embedding rows), but they span [{low}, {high}] (a vocabulary of at "
            f"least {high + 1}). The tokens come from another tokenizer than this model's: "
            "score them with a model of the same vocabulary (for a reference, e.g. "
            "tether.models.frozen_copy of the policy) or re-tokenise them."
        )
    length = longest + new_tokens
    if limits.max_positions is not None and length > limits.max_positions:
        what = (
            f"the longest row has {longest} tokens"
            if not new_tokens
            else f"the longest prompt has {longest} tokens and max_new_tokens={new_tokens}, so a "
            f"sampled sequence (which is scored afterwards) may reach {length} tokens"
        )
        raise ValueError(
            f"{role}: {what}, but {limits.name} has only {limits.max_positions} positions "
            "(config.max_position_embeddings). Shorten the prompts"
            + (" or lower max_new_tokens" if new_tokens else " or responses")
            + " so every sequence fits, or use a model with a longer context."
        )


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


def left_aligned(tokens: Tensor, spans: Spans) -> tuple[Tensor, Tensor, Tensor]:
    """``(tokens [B, W], mask bool [B, W], source long [B * W])``: every row (its run in ``spans``)
    moved to column 0 (right padding, ``W`` its longest run) and, for each flat position of that
    grid, the ``row * T + col`` it came from (0 at padding)."""
    rows, width = spans.mask.shape
    first = torch.arange(rows, device=spans.mask.device) * width + spans.start
    longest = int(spans.lengths.max()) if rows else 0
    source, mask = padded_index(first, spans.lengths, longest, fill_index=0)
    return tokens.reshape(-1)[source], mask, source.reshape(-1)


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
                 kl_to: HeadHidden | None = None, log_probs: bool = True, kl_grad: bool = False) -> None:
        self.head, self.shape, self.kl_grad = head, shape, kl_grad
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
        self.checked = False  # the ops check the first chunk; later chunks share its head, labels and options
        self.source: Tensor | None = None  # see relaid
        self.index: list[Tensor] = []
        self.log_probs: list[Tensor] = []
        self.entropy: list[Tensor] = []
        self.kept: list[Tensor] = []
        self.kl: list[Tensor] = []

    @contextmanager
    def relaid(self, source: Tensor) -> Iterator[None]:
        """While open, the positions handed in are flat indices of a re-laid grid (``left_aligned``)
        and ``source [n]`` maps each one to its ``row * T + col`` in the batch."""
        self.source = source
        try:
            yield
        finally:
            self.source = None

    def _original(self, flat_index: Tensor) -> Tensor:
        return flat_index if self.source is None else self.source[flat_index]

    def _wanted(self, flat_index: Tensor) -> Tensor | None:
        return None if self.where is None else self.where[flat_index]

    def chosen(self, flat_index: Tensor) -> Tensor | None:
        """``bool [n]``: which of these positions are wanted (None: all of them)."""
        return self._wanted(self._original(flat_index))

    def add(self, hidden: Tensor, labels: Tensor, flat_index: Tensor) -> None:
        """Score ``hidden [n, H]`` predicting ``labels [n]`` at batch positions ``flat_index [n]``."""
        flat_index = self._original(flat_index)
        chosen = self._wanted(flat_index)
        if chosen is not None:
            hidden, labels, flat_index = hidden[chosen], labels[chosen], flat_index[chosen]
        head, checked = self.head, not self.checked
        if self.with_log_probs:
            self._append(token_stats_from_hidden(hidden, head.weight, labels, lm_head_bias=getattr(head, "bias", None),
                                                 with_entropy=self.with_entropy, checked=checked, **self.kwargs),
                         flat_index)
        else:
            self.index.append(flat_index)
        if self.keep_hidden:
            self.kept.append(hidden.detach())
        if self.kl_to is not None:
            # A diagnostic unless asked for as a loss term (kl_grad): then its gradient reaches the
            # policy's hidden states and head, the reference staying a constant.
            with torch.set_grad_enabled(self.kl_grad and torch.is_grad_enabled()):
                ref = self.kl_to
                self.kl.append(exact_kl_from_hidden(
                    hidden if self.kl_grad else hidden.detach(), head.weight, ref.hidden[self.rank[flat_index]],
                    ref.weight, lm_head_bias=getattr(head, "bias", None), ref_lm_head_bias=ref.bias, checked=checked,
                    **self.kwargs,
                ))
        self.checked = True

    def add_values(self, stats: TokenStats, flat_index: Tensor) -> None:
        """Values already computed (``[n]`` each) for positions ``flat_index [n]``; those outside
        ``where`` are dropped here (a model without a linear head has no hidden states to narrow)."""
        flat_index = self._original(flat_index)
        chosen = self._wanted(flat_index)
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
