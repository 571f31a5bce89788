"""Scoring rows that share a prompt: each distinct prefix goes through the decoder once.

GRPO scores ``G`` completions of every prompt, and the prompt (with a chat template's
system turn) is often longer than the completion: scoring every row from scratch spends
most of its FLOPs recomputing the same prompt ``G`` times, forward and backward. Here the
batch's columns are cut at a width ``P`` chosen to minimise the decoder's token count:

1. the distinct rows of ``tokens[:, :P]`` (left-padded prompts) run through the decoder
   once, with gradients when grad mode is on, keeping their key/value cache;
2. each row's suffix ``tokens[:, P:]`` (its right-padded response) runs on top of its
   prefix's cache, in length-sorted micro-batches under a token budget;
3. the prediction of token ``P`` comes from the prefix's last hidden state, the rest from
   the suffix's hidden states, and the output head is applied in chunks as usual.

The result equals plain scoring up to float rounding (different batch shapes take
different matmul blockings), and gradients accumulate into the shared prefix once per use,
which is the exact chain rule. The split is only used when every row has a real token at
column ``P - 1`` (so token ``P`` has a context) and the model's cache is a plain
``DynamicCache``; otherwise ``plan_prefix_split`` returns None and callers score normally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tether._compat import cache_layers, new_cache
from tether.models.score_plan import distinct_rows, plan_micro_batches, row_spans
from tether.models.score_sink import TokenSink
from tether.ops import TokenStats, token_stats_from_hidden
from tether.ops.masks import padded_index, position_ids


@dataclass(frozen=True)
class PrefixSplit:
    """Where to cut a ``[B, T]`` batch and which rows share each prefix.

    Attributes:
        width: ``P``, the number of prefix columns (``1 <= P < T``).
        representatives: ``long [U]``, one row holding each distinct prefix.
        inverse: ``long [B]``, the distinct prefix (index into ``representatives``) of each row.
        tokens_saved: decoder tokens the split saves over plain scoring.
    """

    width: int
    representatives: Tensor
    inverse: Tensor
    tokens_saved: int


def plan_prefix_split(tokens: Tensor, attention_mask: Tensor, *, min_saving: float = 0.2) -> PrefixSplit | None:
    """The cut that minimises decoder tokens, or None when it saves under ``min_saving``.

    Args:
        tokens: ``long [B, T]``.
        attention_mask: ``bool [B, T]``, one contiguous run of valid tokens per row.
        min_saving: the fraction of the batch's valid tokens a split must save to be used.
    """
    mask = attention_mask.bool()
    batch, width = tokens.shape
    if batch < 2 or width < 2:
        return None
    keyed = tokens.masked_fill(~mask, -1)
    valid = mask.long()
    total = int(valid.sum())
    # suffix_tokens[P] = valid tokens in columns >= P, summed over rows.
    suffix_tokens = valid.sum(0).flip(0).cumsum(0).flip(0).tolist() + [0]
    group = torch.zeros(batch, dtype=torch.long, device=tokens.device)
    best: tuple[int, int, Tensor, Tensor] | None = None  # (cost, P, representatives, group ids)
    every_row_valid = mask.all(0).tolist()
    for col in range(width - 1):
        # The distinct rows of keyed[:, :col + 1], found one column at a time: (prefix group, token).
        reps, group = distinct_rows(torch.stack([group, keyed[:, col]], dim=1))
        if reps.numel() == batch:
            break  # every row is distinct from here on: longer cuts cannot save anything
        cut = col + 1
        if not every_row_valid[col]:
            continue
        cost = int(valid[reps, :cut].sum()) + suffix_tokens[cut]
        if best is None or cost < best[0]:
            best = (cost, cut, reps, group)
    if best is None or total - best[0] < min_saving * total:
        return None
    cost, cut, reps, group = best
    return PrefixSplit(width=cut, representatives=reps, inverse=group, tokens_saved=total - cost)


def _run_prefixes(
    decoder: nn.Module, prefix_ids: Tensor, prefix_mask: Tensor, token_budget: int
) -> tuple[Tensor, list[tuple[Tensor, Tensor]]] | None:
    """Hidden states ``[U, P, H]`` and per-layer keys/values of the distinct prefixes.

    The left-padded prefixes run right-padded, in length-sorted micro-batches under the token
    budget (a pad query then still sees its row's real keys, where a left pad query would see
    none and some attention kernels return NaN, whose gradient leaks into real keys), and come
    back left-padded to width P; the pad entries are masked for every later query. None when
    the decoder's cache is not a plain full-attention one.
    """
    cut = prefix_ids.shape[1]
    start, lengths = row_spans(prefix_mask)
    flat = prefix_ids.reshape(-1)
    hidden_parts: list[Tensor] = []
    kv_parts: list[list[tuple[Tensor, Tensor]]] = []
    order: list[Tensor] = []
    for rows in plan_micro_batches(lengths, token_budget):
        longest = int(lengths[rows].max())
        index, valid = padded_index(rows * cut + start[rows], lengths[rows], longest, fill_index=0)
        cache = new_cache()
        out = decoder(input_ids=flat[index], attention_mask=valid.long(), past_key_values=cache, use_cache=True)
        layers = cache_layers(cache)
        if layers is None:
            return None
        # Column c of the left-padded layout reads column c - (P - length) of the right-padded one.
        back, left = padded_index(torch.zeros_like(rows), lengths[rows], cut, padding_side="left", fill_index=0)
        hidden_parts.append(_relayout(out.last_hidden_state, back, left, dim=1))
        kv_parts.append([(_relayout(k, back, left, dim=2), _relayout(v, back, left, dim=2)) for k, v in layers])
        order.append(rows)
    back = torch.argsort(torch.cat(order))  # micro-batch order -> representative order
    kv = [(torch.cat([part[i][0] for part in kv_parts])[back], torch.cat([part[i][1] for part in kv_parts])[back])
          for i in range(len(kv_parts[0]))]
    return torch.cat(hidden_parts)[back], kv


def _relayout(values: Tensor, columns: Tensor, keep: Tensor, *, dim: int) -> Tensor:
    """``values`` (rows first, positions along ``dim``) at ``columns [r, P]``, zero where not ``keep``."""
    shape = [1] * values.ndim
    shape[0], shape[dim] = columns.shape
    index = columns.view(shape).expand(*values.shape[:dim], columns.shape[1], *values.shape[dim + 1 :])
    return values.gather(dim, index).masked_fill(~keep.view(shape), 0.0)


def score_with_shared_prefix(
    decoder: nn.Module,
    tokens: Tensor,
    attention_mask: Tensor,
    split: PrefixSplit,
    *,
    token_budget: int,
    sink: TokenSink,
) -> bool:
    """Score ``tokens [B, T]`` with ``split`` (see module doc) into ``sink``.

    Returns False, having scored nothing, when the decoder's cache is not a plain
    ``DynamicCache`` (sliding-window or hybrid layers): the caller must score without sharing.
    """
    mask = attention_mask.bool()
    cut = split.width
    reps = split.representatives
    prefix_ids = tokens[reps, :cut].masked_fill(~mask[reps, :cut], 0)
    prefix_mask = mask[reps, :cut]
    prefix = _run_prefixes(decoder, prefix_ids, prefix_mask, token_budget)
    if prefix is None:
        return False
    prefix_hidden, prefix_kv = prefix
    if cut > 1:
        _score_prefix_tokens(prefix_hidden, prefix_ids, prefix_mask, split, tokens.shape[1], sink)
    _score_suffixes(decoder, tokens, mask, split, prefix_hidden, prefix_kv, token_budget, sink)
    return True


def _score_prefix_tokens(prefix_hidden: Tensor, prefix_ids: Tensor, prefix_mask: Tensor, split: PrefixSplit,
                         width: int, sink: TokenSink) -> None:
    """Tokens ``1..P-1`` of each row, predicted inside its prefix.

    Without ``where`` they are computed once per distinct prefix and copied to every row
    sharing it; with ``where`` only the wanted positions are, row by row (an answer rarely
    reaches into the shared prefix, so there is usually nothing to do).
    """
    keep = (prefix_mask[:, :-1] & prefix_mask[:, 1:])[split.inverse]  # [B, P-1]: predicts token col + 1
    rows, cols = keep.nonzero(as_tuple=True)
    flat = rows * width + cols + 1
    chosen = sink.chosen(flat)
    if chosen is None:
        inner = token_stats_from_hidden(prefix_hidden[:, :-1], sink.head.weight, prefix_ids[:, 1:],
                                        lm_head_bias=getattr(sink.head, "bias", None),
                                        with_entropy=sink.with_entropy, **sink.kwargs)
        which = split.inverse[rows]
        entropy = inner.entropy[which, cols] if sink.with_entropy else None
        sink.add_values(TokenStats(inner.log_probs[which, cols], entropy), flat)
        return
    rows, cols, flat = rows[chosen], cols[chosen], flat[chosen]
    which = split.inverse[rows]
    sink.add(prefix_hidden[which, cols], prefix_ids[which, cols + 1], flat)


def _score_suffixes(decoder: nn.Module, tokens: Tensor, mask: Tensor, split: PrefixSplit, prefix_hidden: Tensor,
                    prefix_kv: list[tuple[Tensor, Tensor]], token_budget: int, sink: TokenSink) -> None:
    """Each row's suffix on top of its prefix's cache; token ``P`` is predicted from the prefix."""
    width, cut = tokens.shape[1], split.width
    suffix_len = mask[:, cut:].sum(-1)
    positions = position_ids(mask)
    with_suffix = (suffix_len > 0).nonzero().flatten()  # rows ending at column P-1 have none
    for group in plan_micro_batches(suffix_len[with_suffix], token_budget):
        rows = with_suffix[group]
        longest = int(suffix_len[rows].max())
        which = split.inverse[rows]
        valid = mask[rows, cut : cut + longest]
        ids = tokens[rows, cut : cut + longest].masked_fill(~valid, 0)  # pad ids may be out of range
        cache = new_cache([(k[which], v[which]) for k, v in prefix_kv])
        hidden = decoder(
            input_ids=ids,
            attention_mask=torch.cat([mask[rows, :cut], valid], dim=1).long(),
            position_ids=positions[rows, cut : cut + longest],
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        context = torch.cat([prefix_hidden[which, -1:], hidden[:, :-1]], dim=1)  # [r, L, H]
        cols = torch.arange(cut, cut + longest, device=ids.device)
        sink.add(context[valid], ids[valid], (rows[:, None] * width + cols[None, :])[valid])
