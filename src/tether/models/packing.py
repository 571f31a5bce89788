"""The two padding-free layouts of a scoring pass: rows packed end to end, and a shared prefix.

Packing: every matrix product of a decoder layer is position-wise, so a pass over rows laid end
to end computes no pad token; only attention must know where a row stops. HF's flash-attention
integrations do that from ``cu_seq_lens_*`` where the kernel is installed; elsewhere
``row_attention`` lays each layer's packed queries, keys and values out per row and runs causal
SDPA, switched on for one pass only (``_compat.attention_kernel``). Sliding-window or
soft-capped attention and checkpointed passes keep right-padded micro-batches.

Shared prefix: GRPO scores ``G`` answers to each prompt, often shorter than the prompt. The
batch's columns are cut at the width ``P`` that minimises the decoder's tokens: the distinct
rows of ``tokens[:, :P]`` run once (with gradients in grad mode) keeping their key/value cache,
each row's suffix runs on top of its prefix's cache in length-sorted micro-batches, token
``P`` is predicted from the prefix's last hidden state. Equal to plain scoring up to float
rounding; gradients reach the shared prefix once per use (the exact chain rule). Used only when
every row has a real token at column ``P - 1`` and the cache is a plain ``DynamicCache``
(else ``plan_prefix_split`` returns None).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tether._compat import (
    attention_implementation,
    attention_kernel,
    cache_layers,
    new_cache,
    register_attention,
    supports_attention_interface,
)
from tether.models.score_plan import Spans, TokenSink, distinct_rows, plan_micro_batches
from tether.ops import TokenStats, token_stats_from_hidden
from tether.ops.masks import padded_index, position_ids, row_runs

# Attention implementations whose Hugging Face integration runs variable-length attention
# from cu_seq_lens, and the package holding their kernel.
VARLEN_ATTENTION = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
ROW_ATTENTION = "tether_row_attention"  # the name row_attention is registered under
# Config switches of attention variants row_attention does not implement.
_UNSUPPORTED_CONFIG = ("sliding_window", "attn_logit_softcapping")


def packed_kernel(model: nn.Module) -> str | None:
    """The attention implementation a packed pass of ``model`` runs, or None (no packing).

    The model's own flash-attention kernel when it is installed; else ``ROW_ATTENTION`` for a
    model whose attention goes through transformers' interface and uses no variant that
    ``row_attention`` lacks (sliding window, soft-capping).
    """
    current = attention_implementation(model)
    kernel = VARLEN_ATTENTION.get(current)
    if kernel is not None:
        return current if importlib.util.find_spec(kernel) is not None else None
    config = getattr(model, "config", None)
    if current not in ("sdpa", "eager") or not supports_attention_interface(model):
        return None
    if any(getattr(config, name, None) is not None for name in _UNSUPPORTED_CONFIG):
        return None
    return ROW_ATTENTION


@dataclass(frozen=True)
class PackedRows:
    """Rows of a ``[B, T]`` batch laid end to end (``N`` valid tokens, ``R`` rows).

    Attributes:
        ids: ``long [1, N]`` the valid tokens, row after row.
        position_ids: ``long [1, N]`` position of each token within its row (restarts at 0).
        labels: ``long [1, N]`` the next token of the same row (0 after a row's last token).
        scored: ``bool [1, N]`` positions whose next token is in the same row.
        flat_index: ``long [n]`` ``row * T + column`` of the label of each scored position.
        bounds: ``int32 [R + 1]`` where each row starts in ``ids``, then ``N``.
        longest: the longest row's length.
    """

    ids: Tensor
    position_ids: Tensor
    labels: Tensor
    scored: Tensor
    flat_index: Tensor
    bounds: Tensor
    longest: int

    def boundaries(self) -> dict:
        """The keyword arguments that carry the row boundaries through a transformers decoder."""
        return {"cu_seq_lens_q": self.bounds, "cu_seq_lens_k": self.bounds,
                "max_length_q": self.longest, "max_length_k": self.longest}


def pack_rows(tokens: Tensor, spans: Spans, rows: Tensor | None = None) -> PackedRows:
    """Pack ``rows`` (default: all, in order) of ``tokens [B, T]`` (their runs in ``spans``, either
    padding side); ``flat_index`` addresses the whole ``[B, T]`` grid."""
    rows = torch.arange(tokens.shape[0], device=tokens.device) if rows is None else rows
    start, lengths = spans.start[rows], spans.lengths[rows]
    owner = torch.repeat_interleave(torch.arange(rows.numel(), device=tokens.device), lengths)
    bounds = torch.zeros(rows.numel() + 1, dtype=torch.long, device=tokens.device)
    bounds[1:] = lengths.cumsum(0)
    position = torch.arange(owner.numel(), device=tokens.device) - bounds[owner]
    row, col = rows[owner], start[owner] + position
    ids = tokens[row, col]
    scored = position < (lengths[owner] - 1)
    labels = torch.zeros_like(ids)
    labels[:-1] = torch.where(scored[:-1], ids[1:], 0)
    flat_index = (row * tokens.shape[1] + col + 1)[scored]
    longest = int(lengths.max()) if rows.numel() else 0
    return PackedRows(ids[None], position[None], labels[None], scored[None], flat_index,
                      bounds.to(torch.int32), longest)


def row_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """Causal attention within each packed row (transformers' attention-interface signature).

    ``query [1, Hq, N, D]``, ``key``/``value`` ``[1, Hkv, N, D]``; row boundaries from
    ``cu_seq_lens_q`` (``[R + 1]``) and ``max_length_q``. Returns ``[1, N, Hq, D]``.
    """
    bounds, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if bounds is None or longest is None or query.shape[0] != 1:
        raise RuntimeError(
            f"{ROW_ATTENTION}: expected one packed row of tokens with cu_seq_lens_q and max_length_q, got a "
            f"batch of {query.shape[0]} without them; it serves tether.models.packing's packed passes only."
        )
    for name in ("sliding_window", "softcap"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{ROW_ATTENTION}: {name}={kwargs[name]!r} is not implemented.")
    bounds = bounds.long()
    # [R, L]: where each row's slots read in the packed tokens; pad slots read an appended zero.
    gather, valid = padded_index(bounds[:-1], bounds.diff(), int(longest), fill_index=query.shape[2])

    def by_row(x: Tensor) -> Tensor:  # [1, H, N, D] -> [R, H, L, D]
        x = torch.cat([x[0], x.new_zeros(x.shape[1], 1, x.shape[3])], dim=1)
        return x[:, gather].transpose(0, 1)

    q, k, v = by_row(query), by_row(key), by_row(value)
    if k.shape[1] != q.shape[1]:  # grouped-query attention
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling)
    return out.transpose(1, 2)[valid][None], None


register_attention(ROW_ATTENTION, row_attention)


def score_packed(decoder: nn.Module, kernel: str, tokens: Tensor, spans: Spans, sink: TokenSink,
                 token_budget: int) -> None:
    """``score_tokens``'s hidden states from packed passes of ``decoder`` attending with ``kernel``
    (``packed_kernel``'s answer), into ``sink`` (see the module doc)."""
    device = sink.head.weight.device
    tokens, spans = tokens.to(device), spans.to(device)
    for rows in plan_micro_batches(spans.lengths, token_budget, packed=True):
        packed = pack_rows(tokens, spans, rows)
        if not packed.scored.any():
            continue  # rows of 0 or 1 token: nothing is predicted
        with attention_kernel(decoder, kernel):
            hidden = decoder(input_ids=packed.ids, position_ids=packed.position_ids, use_cache=False,
                             **packed.boundaries()).last_hidden_state
        sink.add(hidden[packed.scored], packed.labels[packed.scored], packed.flat_index)


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
    start, lengths = row_runs(prefix_mask)  # leading columns of rows the caller checked: one run each
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
