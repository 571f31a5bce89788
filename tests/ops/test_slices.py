"""``tether.ops.masks``: the fixed-size and the near-equal cut of ``range(size)``, against
independent references (Python slicing, ``numpy.array_split``)."""

from __future__ import annotations

import numpy as np
import pytest

from tether.models.score_plan import row_slices as row_slices_of_the_plan
from tether.ops.masks import even_slices, row_slices


@pytest.mark.parametrize("size", [0, 1, 5, 12, 13])
@pytest.mark.parametrize("per", [1, 4, 5, 20])
def test_row_slices_are_python_slices_of_that_step(size, per):
    rows = list(range(size))
    expected = [rows[b : b + per] for b in range(0, size, per)]
    assert [rows[b:e] for b, e in row_slices(size, per)] == expected
    assert row_slices_of_the_plan is row_slices  # the scoring plan's name is the same function


@pytest.mark.parametrize("size", [0, 1, 3, 7, 12, 13])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_even_slices_match_numpy_array_split(size, n):
    parts = np.array_split(np.arange(size), n)
    assert [list(range(b, e)) for b, e in even_slices(size, n)] == [p.tolist() for p in parts]
