"""Padding-free scoring by packing: every row's valid tokens end to end in one sequence.

Hugging Face's flash-attention integrations read sequence boundaries from ``position_ids``
that restart at 0 and run the variable-length kernel, so packed rows attend only within
themselves and no pad token is computed at all. SDPA and eager attention read no such
boundaries: packed rows would attend across each other. ``packing_supported`` therefore
says yes only for a flash-attention implementation whose kernel is installed (a CUDA
machine); everywhere else ``score_tokens`` keeps its right-padded micro-batches.

One packed pass holds the whole batch, so its activations are the batch's real tokens
only; callers that need a bound cut the batch first (the trainer's micro-batches do).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tether._compat import attention_implementation
from tether.models.score_plan import row_spans
from tether.models.score_sink import TokenSink

# Attention implementations whose Hugging Face integration turns restarting position_ids into
# variable-length attention, and the package holding their kernel.
VARLEN_ATTENTION = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def packing_supported(model: nn.Module) -> bool:
    """Whether ``model`` attends within packed rows only (a flash-attention kernel that is installed)."""
    kernel = VARLEN_ATTENTION.get(attention_implementation(model))
    return kernel is not None and importlib.util.find_spec(kernel) is not None


@dataclass(frozen=True)
class PackedRows:
    """A ``[B, T]`` batch laid end to end (``N`` valid tokens).

    Attributes:
        ids: ``long [1, N]`` the valid tokens, row after row.
        position_ids: ``long [1, N]`` position of each token within its row (restarts at 0).
        labels: ``long [1, N]`` the next token of the same row (0 after a row's last token).
        scored: ``bool [1, N]`` positions whose next token is in the same row.
        flat_index: ``long [n]`` ``row * T + column`` of the label of each scored position.
    """

    ids: Tensor
    position_ids: Tensor
    labels: Tensor
    scored: Tensor
    flat_index: Tensor


def pack_rows(tokens: Tensor, attention_mask: Tensor) -> PackedRows:
    """Pack ``tokens [B, T]`` (one contiguous run of valid tokens per row, either padding side)."""
    start, lengths = row_spans(attention_mask)
    mask = attention_mask.bool()
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: each row's tokens in order
    position = cols - start[rows]
    ids = tokens[rows, cols]
    scored = position < (lengths[rows] - 1)
    labels = torch.zeros_like(ids)
    labels[:-1] = torch.where(scored[:-1], ids[1:], 0)
    flat_index = (rows * tokens.shape[1] + cols + 1)[scored]
    return PackedRows(ids[None], position[None], labels[None], scored[None], flat_index)


def score_packed(decoder: nn.Module, tokens: Tensor, attention_mask: Tensor, sink: TokenSink) -> None:
    """``score_tokens``'s hidden states from one packed pass of ``decoder``, into ``sink`` (see the module doc)."""
    device = sink.head.weight.device
    packed = pack_rows(tokens.to(device), attention_mask.to(device))
    hidden = decoder(input_ids=packed.ids, position_ids=packed.position_ids).last_hidden_state
    sink.add(hidden[packed.scored], packed.labels[packed.scored], packed.flat_index)
