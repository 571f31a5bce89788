"""Padding-free scoring by packing: rows' valid tokens end to end, attention kept within each row.

Every matrix product of a decoder layer is position-wise, so a pass over rows laid end to end
computes no pad token; only attention must know where a row stops. Hugging Face's
flash-attention integrations do that from ``cu_seq_lens_*`` where their kernel is installed;
elsewhere tether's ``row_attention`` lays each layer's packed queries, keys and values out per
row and runs causal SDPA. ``row_attention`` is switched on for one pass only
(``_compat.attention_kernel``) and refuses a call without row boundaries. Models with sliding
windows or soft-capped attention, and checkpointed passes, keep the right-padded micro-batches
of ``tether.models.scoring``. Passes are cut by ``score_plan.plan_micro_batches(packed=True)``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tether._compat import attention_implementation, attention_kernel, register_attention, supports_attention_interface
from tether.models.score_plan import plan_micro_batches, row_spans
from tether.models.score_sink import TokenSink
from tether.ops.masks import padded_index

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


def pack_rows(tokens: Tensor, attention_mask: Tensor, rows: Tensor | None = None) -> PackedRows:
    """Pack ``rows`` (default: all, in order) of ``tokens [B, T]`` (each row one contiguous run
    of valid tokens, either padding side); ``flat_index`` addresses the whole ``[B, T]`` grid."""
    rows = torch.arange(tokens.shape[0], device=tokens.device) if rows is None else rows
    start, lengths = row_spans(attention_mask[rows])
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


def score_packed(decoder: nn.Module, kernel: str, tokens: Tensor, attention_mask: Tensor, sink: TokenSink,
                 token_budget: int) -> None:
    """``score_tokens``'s hidden states from packed passes of ``decoder`` attending with ``kernel``
    (``packed_kernel``'s answer), into ``sink`` (see the module doc)."""
    device = sink.head.weight.device
    tokens, attention_mask = tokens.to(device), attention_mask.to(device)
    _, lengths = row_spans(attention_mask)
    for rows in plan_micro_batches(lengths, token_budget, packed=True):
        packed = pack_rows(tokens, attention_mask, rows)
        if not packed.scored.any():
            continue  # rows of 0 or 1 token: nothing is predicted
        with attention_kernel(decoder, kernel):
            hidden = decoder(input_ids=packed.ids, position_ids=packed.position_ids, use_cache=False,
                             **packed.boundaries()).last_hidden_state
        sink.add(hidden[packed.scored], packed.labels[packed.scored], packed.flat_index)
