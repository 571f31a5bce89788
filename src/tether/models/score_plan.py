"""The scoring plan: how a padded ``[B, T]`` batch is cut into forward passes and put back.

One planner serves every scorer in ``tether.models`` (plain padding-free scoring, exact KL,
the shared-prefix split's prefix and suffix passes, the sampler's prefill): rows are grouped
longest first so that each pass's padded size stays under a token budget, a pass is laid
out right-padded (``tether.ops.masks.padded_index``), and per-token values come back to the
batch's grid through one flat scatter index. Rows that repeat a prefix are grouped by ``distinct_rows``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tether.ops.masks import padded_index, row_runs
from tether.ops.slices import row_slices  # also imported from here by the callers that cut rows


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


def iter_micro_batches(tokens: Tensor, attention_mask: Tensor, token_budget: int, device) -> list[MicroBatch]:
    """Cut a padded batch into length-sorted, right-padded micro-batches (see module doc)."""
    start, lengths = row_spans(attention_mask)
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
