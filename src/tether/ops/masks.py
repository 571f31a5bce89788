"""Token masks, row slices and the padded <-> nested layouts, vectorised over rows.

Padded layout: ``[B, T, ...]`` plus ``bool [B, T]``. With ``padding_side="right"`` a row's
valid tokens sit at ``[0, length)``; with ``"left"`` at ``[T - length, T)``. Every layout of
rows into a padded grid (nested tensors, lists of rows, packed rows, another grid's runs,
``repack``) reads its entries through ``padded_index``.

Nested layout: a ``torch.jagged`` nested tensor ``[B, j, ...]``: one contiguous ``values``
buffer plus ``offsets``, so both directions are one boolean-mask gather/scatter with no loop
over rows, gradients flow through ``values``, and empty rows are allowed (strided nested
tensors are accepted by ``nested_to_padded`` at the cost of a loop). A padded batch whose mask
is one contiguous block per row round-trips exactly on either side. The ragged dim need not
be dim 1 (stacked ``[1, n_b, 1]`` rows give ``[B, 1, j, 1]``); the mask is always ``[B, T]``
over it.

``row_slices`` cuts ``range(size)`` into fixed-size ``(begin, end)`` parts (vocabulary chunks,
micro-batches, evaluation batches); ``even_slices`` into ``n`` parts whose sizes differ by at
most one (mini-batches, the groups each rollout worker samples).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from tether._compat import jagged_ragged_dim
from tether.ops.checks import lookup, whole_number


@dataclass(frozen=True)
class Padded:
    """A padded batch: ``values [B, T, ...]`` and its ``mask bool [B, T]``."""

    values: Tensor
    mask: Tensor


def _right_starts(lengths: Tensor, total: int) -> Tensor:
    return torch.zeros_like(lengths)


def _left_starts(lengths: Tensor, total: int) -> Tensor:
    return total - lengths


# Where each row's valid block begins, given the lengths [B] and the padded length T.
PADDING_SIDES: dict[str, Callable[[Tensor, int], Tensor]] = {
    "right": _right_starts,
    "left": _left_starts,
}


def _side(padding_side: str) -> Callable[[Tensor, int], Tensor]:
    return lookup(PADDING_SIDES, padding_side, "padding_side")


def _check_lengths(name: str, lengths: Tensor, total: int) -> None:
    if not isinstance(lengths, Tensor) or lengths.is_floating_point() or lengths.dtype == torch.bool:
        got = lengths.dtype if isinstance(lengths, Tensor) else type(lengths).__name__
        raise TypeError(f"{name} must be an integer tensor [B]; got {got}. Use .long().")
    if lengths.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B]; got shape {tuple(lengths.shape)}.")
    if bool(((lengths < 0) | (lengths > total)).any()):
        raise ValueError(
            f"{name} must lie in [0, T={total}]; got min {lengths.min().tolist()} and max "
            f"{lengths.max().tolist()}. Raise T or truncate the sequences first."
        )


def _check_total(total: int) -> None:
    whole_number("T", total, low=0)


def _window(start: Tensor, stop: Tensor, total: int) -> Tensor:
    positions = torch.arange(total, device=start.device)
    return (positions >= start[:, None]) & (positions < stop[:, None])


def mask_from_lengths(lengths: Tensor, T: int, *, padding_side: str = "right") -> Tensor:
    """Valid-token mask of rows of the given lengths padded to ``T``.

    Args:
        lengths: ``[B]`` integer lengths in ``[0, T]``.
        T: padded length.
        padding_side: ``"right"`` (tokens first) or ``"left"`` (padding first).

    Returns:
        ``bool [B, T]``.
    """
    starts = _side(padding_side)
    _check_total(T)
    _check_lengths("lengths", lengths, T)
    begin = starts(lengths, T)
    return _window(begin, begin + lengths, T)


def row_runs(mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(start [B], length [B])`` of each row of ``mask bool [B, T]``: its first valid column
    (0 for an empty row) and its count of valid entries. They describe the row only when its
    valid entries are one contiguous run (``tether.models.score_plan.row_spans`` checks that)."""
    mask = mask.bool()
    lengths = mask.sum(-1)
    return torch.where(lengths > 0, mask.int().argmax(-1), torch.zeros_like(lengths)), lengths


def position_ids(mask: Tensor) -> Tensor:
    """``long [B, T]``: each valid entry's index among its row's valid entries (0 at padding
    before them): the position ids of a padded batch whose rows start at its first token."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def padded_index(starts: Tensor, lengths: Tensor, T: int, *, padding_side: str = "right",
                 fill_index: int = -1) -> tuple[Tensor, Tensor]:
    """Where each position of a ``[B, T]`` grid padded on ``padding_side`` takes its entry from.

    Row ``b`` is the entries ``starts[b] : starts[b] + lengths[b]`` of a flat source: rows laid
    end to end (a nested tensor's values, packed rows) or a ``[B, S]`` grid flattened
    (``starts = b * S + first column``). ``lengths`` must lie in ``[0, T]``; unlike
    ``mask_from_lengths`` nothing is checked here, so there is no host sync.

    Returns:
        ``(index long [B, T], mask bool [B, T])``: the source position of each valid entry,
        ``fill_index`` at padding; ``mask`` as ``mask_from_lengths`` gives it.
    """
    begin = _side(padding_side)(lengths, T)
    mask = _window(begin, begin + lengths, T)
    cols = torch.arange(T, device=lengths.device)
    return torch.where(mask, (starts - begin)[:, None] + cols, fill_index), mask


def rows_to_padded(values: Tensor, starts: Tensor, lengths: Tensor, T: int, *, padding_side: str = "right",
                   padding_value: float | int | bool = 0) -> Padded:
    """The rows held in ``values [N, ...]`` (row ``b`` at ``starts[b] : starts[b] + lengths[b]``,
    see ``padded_index``) as ``Padded(values [B, T, ...], mask bool [B, T])``; differentiable
    w.r.t. ``values``."""
    index, mask = padded_index(starts, lengths, T, padding_side=padding_side, fill_index=values.shape[0])
    fill = values.new_full((1, *values.shape[1:]), padding_value)
    return Padded(values=torch.cat([values, fill])[index], mask=mask)


def pad_rows(rows: Sequence[Tensor], *, padding_value: float | int | bool = 0, padding_side: str = "right") -> Padded:
    """Tensors ``[n_b, ...]`` (one dtype and device) padded to the longest into
    ``Padded(values [B, T, ...], mask bool [B, T])``; no rows give ``long [0, 0]``."""
    values, starts, lengths = _end_to_end(rows)
    return rows_to_padded(values, starts, lengths, int(lengths.max()) if rows else 0, padding_side=padding_side,
                          padding_value=padding_value)


def flat_runs(mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """``(starts [B], lengths [B], W)``: each row's contiguous run of valid entries of ``mask [B, T]``
    as a run of the flattened grid (``starts = b * T + first column``, the source ``padded_index``
    and ``rows_to_padded`` read), and ``W`` the longest run."""
    start, lengths = row_runs(mask)
    rows, span = mask.shape
    first = torch.arange(rows, device=mask.device) * span + start
    return first, lengths, int(lengths.max()) if lengths.numel() else 0


def repack(values: Tensor, mask: Tensor, padding_side: str, *,
           padding_value: float | int | bool = 0) -> tuple[Tensor, Tensor]:
    """``(values [B, W, ...], mask bool [B, W])``: each row's contiguous run of valid entries of
    ``values [B, T, ...]`` re-laid so its padding (``padding_value``) sits on ``padding_side``, the
    width ``W`` cropped to the longest run."""
    starts, lengths, width = flat_runs(mask)
    padded = rows_to_padded(values.reshape(mask.numel(), *values.shape[2:]), starts, lengths, width,
                            padding_side=padding_side, padding_value=padding_value)
    return padded.values, padded.mask


def _end_to_end(rows: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(values [N, ...], starts [B], lengths [B])`` of rows laid end to end."""
    values = torch.cat(list(rows)) if rows else torch.zeros(0, dtype=torch.long)
    lengths = torch.tensor([row.shape[0] for row in rows], dtype=torch.long, device=values.device)
    return values, lengths.cumsum(0) - lengths, lengths


def response_mask(
    prompt_lengths: Tensor, lengths: Tensor, T: int, *, padding_side: str = "right"
) -> Tensor:
    """Mask of the response tokens: the part of each row after its prompt.

    Args:
        prompt_lengths: ``[B]`` prompt lengths, ``<= lengths``.
        lengths: ``[B]`` total (prompt + response) lengths in ``[0, T]``.
        T: padded length.
        padding_side: side of the padding, as in ``mask_from_lengths``.

    Returns:
        ``bool [B, T]``, True on positions ``[prompt_length, length)`` of each row's valid
        block.
    """
    starts = _side(padding_side)
    _check_total(T)
    _check_lengths("lengths", lengths, T)
    _check_lengths("prompt_lengths", prompt_lengths, T)
    if prompt_lengths.shape != lengths.shape:
        raise ValueError(
            f"prompt_lengths must have the shape of lengths {tuple(lengths.shape)}; got {tuple(prompt_lengths.shape)}."
        )
    if bool((prompt_lengths > lengths).any()):
        raise ValueError(
            "prompt_lengths must be <= lengths (lengths count prompt and response together); "
            f"got prompt_lengths {prompt_lengths.tolist()} and lengths {lengths.tolist()}."
        )
    begin = starts(lengths, T)
    return _window(begin + prompt_lengths, begin + lengths, T)


def _eos_tensor(eos_ids: int | Sequence[int] | Tensor, device: torch.device) -> Tensor:
    if isinstance(eos_ids, Tensor):
        if eos_ids.is_floating_point() or eos_ids.dtype == torch.bool:
            raise TypeError(f"eos_ids: expected an integer tensor, an int or a sequence of ints, got {eos_ids!r}.")
        ids = eos_ids.reshape(-1)
    else:
        items = eos_ids if isinstance(eos_ids, Sequence) and not isinstance(eos_ids, str) else [eos_ids]
        ids = torch.tensor([whole_number("eos_ids", i, fix="Pass a token id or a sequence of them.") for i in items],
                           dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("eos_ids is empty; pass at least one end-of-sequence token id.")
    return ids.to(device)


def truncate_at_first_eos(tokens: Tensor, mask: Tensor, eos_ids: int | Sequence[int] | Tensor) -> Tensor:
    """Mask that keeps each row up to and including its first valid end-of-sequence token.

    Only tokens inside ``mask`` count as an end of sequence, so a pad id equal to the eos
    id (common with left padding) does not truncate anything. Rows without an eos are
    returned unchanged.

    Args:
        tokens: ``[B, T]`` token ids.
        mask: ``bool [B, T]`` valid tokens.
        eos_ids: one id or several (any of them ends a sequence).

    Returns:
        ``bool [B, T]``, a subset of ``mask``.
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError("mask must be a bool tensor [B, T]; use mask.bool().")
    if not isinstance(tokens, Tensor) or tokens.shape != mask.shape or tokens.dim() != 2:
        got = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(f"tokens must be [B, T] with the mask's shape {tuple(mask.shape)}; got {got}.")
    ends = torch.isin(tokens, _eos_tensor(eos_ids, tokens.device)) & mask
    ends_before = ends.cumsum(dim=-1) - ends.long()
    return mask & (ends_before == 0)


def padded_to_nested(x: Tensor, mask: Tensor, *, ragged_dim: int = 1) -> Tensor:
    """Jagged nested tensor of each row's valid entries, in order.

    Args:
        x: ``[B, T, ...]`` padded values (any side); with ``ragged_dim=r``,
            ``[B, *pre, T, *post]`` with ``T`` at dim ``r``.
        mask: ``bool [B, T]`` valid entries along the ragged dim.
        ragged_dim: the dim of ``x`` that becomes jagged (>= 1).

    Returns:
        ``torch.jagged`` nested tensor ``[B, *pre, j, *post]`` whose row ``b`` holds the
        entries of ``x[b]`` where ``mask[b]``; differentiable w.r.t. ``x``.
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise TypeError("mask must be a bool tensor [B, T]; use mask.bool().")
    dims = x.dim() if isinstance(x, Tensor) else 0
    whole_number("ragged_dim", ragged_dim, low=1, high=max(dims, 2) - 1,
                 fix=f"x has {dims} dims; name one after the batch dim (at most x.dim() - 1).")
    if dims < 2 or (x.shape[0], x.shape[ragged_dim]) != tuple(mask.shape):
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(
            f"x must have B = {mask.shape[0]} at dim 0 and T = {mask.shape[1]} at dim {ragged_dim} "
            f"(the mask's [B, T]); got {got}."
        )
    lengths = mask.sum(dim=-1)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(dim=0)])
    values = x.movedim(ragged_dim, 1)[mask].movedim(0, ragged_dim - 1)
    return torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=ragged_dim)


def ragged_dim_of(x: Tensor) -> int:
    """The dim along which a jagged nested tensor's rows differ (1 for strided ones)."""
    return jagged_ragged_dim(x) if x.layout == torch.jagged else 1


def _flat_rows(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(values [N, ...] (ragged dim first), starts [B], lengths [B])`` of a nested tensor."""
    if x.layout == torch.jagged:
        offsets = x.offsets()
        lengths = x.lengths() if x.lengths() is not None else offsets.diff()
        return x.values().movedim(ragged_dim_of(x) - 1, 0), offsets[:-1], lengths
    # Strided nested tensors keep one buffer per row: there is no flat view to gather from.
    return _end_to_end(x.unbind())


def nested_to_padded(
    x: Tensor,
    *,
    padding_value: float = 0,
    padding_side: str = "right",
    total_length: int | None = None,
) -> Padded:
    """Padded tensor and mask from a nested tensor ``[B, j, ...]``.

    Args:
        x: nested tensor (jagged, or strided) whose rows are ``[n_b, ...]``; a jagged
            tensor ragged at dim ``r > 1`` (rows ``[*pre, n_b, *post]``) is padded along
            that dim.
        padding_value: value written at padded positions.
        padding_side: ``"right"`` or ``"left"``.
        total_length: padded length ``T``; default the longest row. Must be at least that.

    Returns:
        ``Padded(values [B, T, ...], mask bool [B, T])`` (values ``[B, *pre, T, *post]``
        for a ragged dim ``r > 1``); differentiable w.r.t. ``x``.
    """
    if not isinstance(x, Tensor) or not x.is_nested:
        raise TypeError(f"x must be a nested tensor; got {type(x).__name__}. Build one with padded_to_nested.")
    _side(padding_side)
    values, starts, lengths = _flat_rows(x)
    longest = int(lengths.max()) if lengths.numel() else 0
    if total_length is None:
        total_length = longest
    _check_total(total_length)
    if total_length < longest:
        raise ValueError(
            f"total_length={total_length} is shorter than the longest row ({longest}); "
            "pass total_length >= the longest row, or None."
        )
    padded = rows_to_padded(values, starts, lengths, total_length, padding_side=padding_side,
                            padding_value=padding_value)
    return Padded(values=padded.values.movedim(1, ragged_dim_of(x)), mask=padded.mask)


def row_slices(size: int, rows_per_slice: int) -> list[tuple[int, int]]:
    """``(begin, end)`` of consecutive slices of ``rows_per_slice`` rows of ``range(size)``
    (the last may be shorter): the one way a batch of rows is cut into fixed-size parts."""
    return [(begin, min(begin + rows_per_slice, size)) for begin in range(0, size, rows_per_slice)]


def even_slices(size: int, n: int) -> list[tuple[int, int]]:
    """``(begin, end)`` of ``n`` consecutive slices of ``range(size)``, the first ``size % n``
    one longer (empty slices when ``n > size``)."""
    base, extra = divmod(size, n)
    bounds, begin = [], 0
    for k in range(n):
        end = begin + base + (1 if k < extra else 0)
        bounds.append((begin, end))
        begin = end
    return bounds
