"""The one re-layout of rows into a padded grid (``tether.ops.masks``: ``row_runs``,
``padded_index``, ``rows_to_padded``, ``pad_rows``) against element-by-element Python loops,
in float64 and exactly; the re-layouts built on it are held to the same loops in
``tests/models/test_layouts.py``."""

from __future__ import annotations

import pytest
import torch

from tether.ops import nested_to_padded
from tether.ops.masks import pad_rows, padded_index, position_ids, row_runs, rows_to_padded

SIDES = ["right", "left"]


def _naive_padded(rows: list[torch.Tensor], width: int, side: str, fill) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row, entry by entry: row b's entries on ``side`` of a [B, width, ...] grid."""
    trailing = rows[0].shape[1:] if rows else ()
    out = torch.full((len(rows), width, *trailing), fill, dtype=rows[0].dtype if rows else torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        begin = 0 if side == "right" else width - row.shape[0]
        for t in range(row.shape[0]):
            out[b, begin + t] = row[t]
            mask[b, begin + t] = True
    return out, mask


def _ragged(seed: int, trailing: tuple[int, ...] = ()) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (5,), generator=g).tolist()
    return [torch.randn(n, *trailing, generator=g, dtype=torch.float64) for n in lengths]


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("trailing", [(), (3,), (2, 2)])
@pytest.mark.parametrize("seed", range(3))
def test_pad_rows_equals_a_loop(side, trailing, seed):
    rows = _ragged(seed, trailing)
    got = pad_rows(rows, padding_value=-7.0, padding_side=side)
    width = max(r.shape[0] for r in rows)
    values, mask = _naive_padded(rows, width, side, -7.0)
    assert torch.equal(got.values, values) and torch.equal(got.mask, mask)


def test_pad_rows_of_ids_and_flags_and_of_nothing():
    ids = pad_rows([torch.tensor([5, 6]), torch.tensor([7])], padding_value=2, padding_side="left")
    assert ids.values.tolist() == [[5, 6], [2, 7]] and ids.values.dtype == torch.long
    flags = pad_rows([torch.tensor([True]), torch.tensor([False, True])], padding_value=False)
    assert flags.values.tolist() == [[True, False], [False, True]] and flags.mask.tolist() == [[True, False], [True, True]]
    empty = pad_rows([])
    assert empty.values.shape == (0, 0) and empty.values.dtype == torch.long and empty.mask.shape == (0, 0)


@pytest.mark.parametrize("side", SIDES)
def test_rows_to_padded_reads_rows_anywhere_in_a_buffer_and_passes_gradients(side):
    """Rows need not be back to back (a jagged tensor with holes, a flattened grid's runs)."""
    buffer = torch.arange(20, dtype=torch.float64).requires_grad_()
    starts, lengths = torch.tensor([3, 0, 12, 19]), torch.tensor([4, 0, 2, 1])
    got = rows_to_padded(buffer, starts, lengths, 5, padding_side=side, padding_value=0.5)
    rows = [buffer.detach()[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist())]
    values, mask = _naive_padded(rows, 5, side, 0.5)
    assert torch.equal(got.values.detach(), values) and torch.equal(got.mask, mask)
    got.values.sum().backward()
    used = torch.zeros(20, dtype=torch.float64)
    for s, n in zip(starts.tolist(), lengths.tolist()):
        used[s : s + n] = 1
    assert torch.equal(buffer.grad, used)


def test_padded_index_marks_padding_and_matches_mask_from_lengths():
    index, mask = padded_index(torch.tensor([10, 0]), torch.tensor([2, 3]), 4, padding_side="left", fill_index=99)
    assert index.tolist() == [[99, 99, 10, 11], [99, 0, 1, 2]]
    assert mask.tolist() == [[False, False, True, True], [False, True, True, True]]


def test_row_runs_equals_a_scan():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(7, 6, generator=g) < 0.5
    mask[0] = False
    start, lengths = row_runs(mask)
    for b, row in enumerate(mask.tolist()):
        assert lengths[b] == sum(row)
        assert start[b] == (row.index(True) if any(row) else 0)


@pytest.mark.parametrize("side", SIDES)
def test_nested_to_padded_equals_a_loop(side):
    rows = _ragged(5, (3,))
    got = nested_to_padded(torch.nested.nested_tensor(rows, layout=torch.jagged), padding_side=side,
                           padding_value=1.5, total_length=8)
    values, mask = _naive_padded(rows, 8, side, 1.5)
    assert torch.equal(got.values, values) and torch.equal(got.mask, mask)


def test_position_ids_count_each_rows_valid_entries():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]]
