"""Cutting ``range(size)`` into contiguous ``(begin, end)`` slices: the one place for both ways.

``row_slices`` cuts fixed-size parts (the last may be shorter): vocabulary chunks of the ops,
update micro-batches, evaluation and reward-model batches, stored old log-probs.
``even_slices`` cuts ``n`` parts whose sizes differ by at most one, the first ones longer:
the update's mini-batches and the groups each rollout worker samples.
"""

from __future__ import annotations

__all__ = ["even_slices", "row_slices"]


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
