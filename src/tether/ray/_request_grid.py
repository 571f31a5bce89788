"""Concatenate the rows of several scoring requests into one grid, and split the result back.

Each request is a ``[b_i, T_i]`` batch padded on either side. Every row's contiguous run of
valid tokens is copied to the left of a shared ``[sum b_i, L]`` right-padded grid (``L`` the
longest run; ``tether.ops.masks.padded_index``), which ``score_tokens`` scores in one call;
``unpack`` puts each row's log-probs back at the positions its tokens had in the caller's own
layout (``score_plan.scatter_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tether.models.score_plan import row_spans, scatter_tokens
from tether.ops.masks import padded_index

__all__ = ["RequestGrid", "join_requests", "split_requests"]


@dataclass(frozen=True)
class RowPlacement:
    """Where one request's rows sit in the caller's layout and in the packed grid."""

    first_row: int  # index of the request's first row in the packed grid
    source: Tensor  # long [b, L]: caller position row * T + column of each packed position
    valid: Tensor  # bool [b, L]: packed positions that hold a real token
    shape: tuple[int, int]  # the caller's [b, T]


@dataclass(frozen=True)
class RequestGrid:
    """The rows of several requests in one right-padded grid, and how to split it back (not
    ``tether.models.packing``'s end-to-end packing)."""

    ids: Tensor  # long [N, L], right-padded with 0
    mask: Tensor  # bool [N, L]
    placements: list[RowPlacement]


def join_requests(batches: list[tuple[Tensor, Tensor]]) -> RequestGrid:
    """Pack ``[(tokens [b_i, T_i], mask bool [b_i, T_i]), ...]`` into one right-padded grid."""
    spans = [row_spans(mask) for _, mask in batches]
    width = max([int(lengths.max()) for _, lengths in spans if lengths.numel()] + [1])
    ids, masks, placements = [], [], []
    first = 0
    for (tokens, _), (start, lengths) in zip(batches, spans):
        rows, span = tokens.shape
        flat = torch.cat([tokens.reshape(-1).long(), tokens.new_zeros(1, dtype=torch.long)])  # padding reads 0
        source, valid = padded_index(torch.arange(rows) * span + start, lengths, width, fill_index=rows * span)
        ids.append(flat[source])
        masks.append(valid)
        placements.append(RowPlacement(first, source, valid, (rows, span)))
        first += rows
    return RequestGrid(torch.cat(ids), torch.cat(masks), placements)


def split_requests(values: Tensor, packed: RequestGrid) -> list[Tensor]:
    """Split per-token ``values [N, L]`` of a packed grid into each request's ``[b_i, T_i]``.

    Positions a request did not send as valid tokens hold 0.
    """
    out = []
    for place in packed.placements:
        rows, span = place.shape
        part = values[place.first_row : place.first_row + rows]
        out.append(scatter_tokens([place.source[place.valid]], [part[place.valid]], rows, span, values.device))
    return out
