"""Re-layouts of ``tether.models`` built on ``tether.ops.masks.padded_index`` (``batch_io.repack``,
``score_plan.iter_micro_batches``) against Python loops, exactly."""

from __future__ import annotations

import pytest
import torch

from tether.ops.masks import repack
from tether.models.score_plan import Spans, iter_micro_batches, plan_micro_batches
from tests.ops.test_relayout import SIDES, _naive_padded, _ragged


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("from_side", SIDES)
def test_repack_equals_a_loop(side, from_side):
    rows = _ragged(4, (2,))
    values, mask = _naive_padded(rows, 7, from_side, float("nan"))  # NaN padding must not leak
    got, got_mask = repack(values, mask, side)
    expected, expected_mask = _naive_padded(rows, max(r.shape[0] for r in rows), side, 0.0)
    assert torch.equal(got, expected) and torch.equal(got_mask, expected_mask)


@pytest.mark.parametrize("budget", [1, 6, 100])
def test_micro_batches_lay_rows_out_right_padded_with_their_grid_positions(budget):
    """Each pass of the plan, row by row: the batch row's valid tokens right-padded with 0, and
    flat_index = row * T + column of each predicted token (every valid token after the first)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 50, (6, 7), generator=g)
    lengths, starts = [3, 0, 7, 1, 5, 2], [4, 0, 0, 6, 1, 3]
    mask = torch.zeros(6, 7, dtype=torch.bool)
    for b, (n, s) in enumerate(zip(lengths, starts)):
        mask[b, s : s + n] = True
    passes = [rows.tolist() for rows in plan_micro_batches(torch.tensor(lengths), budget)]
    passes = [rows for rows in passes if max(lengths[b] for b in rows) >= 2]  # nothing to predict otherwise
    got = iter_micro_batches(tokens, Spans.of(mask), budget, "cpu")
    assert len(got) == len(passes)
    for mb, rows in zip(got, passes):
        width = max(lengths[b] for b in rows)
        ids = [tokens[b, starts[b] : starts[b] + lengths[b]].tolist() + [0] * (width - lengths[b]) for b in rows]
        flat = [b * 7 + starts[b] + t for b in rows for t in range(1, lengths[b])]
        assert mb.ids.tolist() == ids
        assert mb.valid.tolist() == [[t < lengths[b] for t in range(width)] for b in rows]
        assert mb.flat_index.tolist() == flat
