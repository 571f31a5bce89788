"""Masks from lengths, response masks, first-EOS truncation and padded <-> nested layouts."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.ops import (
    PADDING_SIDES,
    Padded,
    mask_from_lengths,
    nested_to_padded,
    padded_to_nested,
    ragged_dim_of,
    response_mask,
    truncate_at_first_eos,
)


def _rows(mask: torch.Tensor) -> list[list[int]]:
    return mask.int().tolist()


def test_mask_from_lengths_both_sides():
    lengths = torch.tensor([2, 0, 4])
    assert _rows(mask_from_lengths(lengths, 4)) == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert _rows(mask_from_lengths(lengths, 4, padding_side="left")) == [[0, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert mask_from_lengths(torch.zeros(2, dtype=torch.long), 0).shape == (2, 0)
    assert set(PADDING_SIDES) == {"right", "left"}


def test_response_mask_both_sides():
    """Row 0: 2 prompt + 1 response token in T = 5; row 1: 1 + 3. Right padding puts the
    response at [2, 3) and [1, 4); left padding shifts each row by T - length (2 and 1)."""
    prompt, total = torch.tensor([2, 1]), torch.tensor([3, 4])
    assert _rows(response_mask(prompt, total, 5)) == [[0, 0, 1, 0, 0], [0, 1, 1, 1, 0]]
    assert _rows(response_mask(prompt, total, 5, padding_side="left")) == [[0, 0, 0, 0, 1], [0, 0, 1, 1, 1]]


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=5),
    st.sampled_from(["left", "right"]),
)
def test_response_mask_is_valid_mask_minus_prompt(pairs, side):
    """The response mask is the valid mask minus the first prompt_length valid tokens."""
    prompt = torch.tensor([min(a, b) for a, b in pairs])
    total = torch.tensor([max(a, b) for a, b in pairs])
    got = response_mask(prompt, total, 6, padding_side=side)
    valid = mask_from_lengths(total, 6, padding_side=side)
    rank = valid.cumsum(-1)  # 1-based rank of each valid token within its row
    assert torch.equal(got, valid & (rank > prompt[:, None]))


def test_mask_errors():
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, T=3\]; got min 1 and max 4"):
        mask_from_lengths(torch.tensor([1, 4]), 3)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, T=3\]"):
        mask_from_lengths(torch.tensor([-1]), 3)
    with pytest.raises(TypeError, match=r"lengths must be an integer tensor"):
        mask_from_lengths(torch.tensor([1.0]), 3)
    with pytest.raises(ValueError, match=r"lengths must be 1-D"):
        mask_from_lengths(torch.tensor([[1]]), 3)
    with pytest.raises(ValueError, match=r"padding_side: expected one of .*'right', 'left'.*, got 'center'"):
        mask_from_lengths(torch.tensor([1]), 3, padding_side="center")
    with pytest.raises(ValueError, match=r"T: expected an int >= 0, got -1"):
        mask_from_lengths(torch.tensor([0]), -1)
    with pytest.raises(ValueError, match=r"prompt_lengths must be <= lengths"):
        response_mask(torch.tensor([3]), torch.tensor([2]), 4)
    with pytest.raises(ValueError, match=r"prompt_lengths must have the shape of lengths"):
        response_mask(torch.tensor([1, 1]), torch.tensor([2]), 4)


# ---------------------------------------------------------------- first eos


def test_truncate_at_first_eos_hand_values():
    """eos ids {2, 7}. Row 0: first eos at position 1 -> keep [0, 1]. Row 1: no eos ->
    unchanged. Row 2 (left padded, pad id 2 = eos): padding is outside the mask, so the
    first *valid* eos is at 3. Row 3: eos id 7 at 2."""
    tokens = torch.tensor([[5, 2, 6, 2], [5, 6, 6, 6], [2, 5, 6, 2], [5, 6, 7, 9]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    out = truncate_at_first_eos(tokens, mask, [2, 7])
    assert _rows(out) == [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [1, 1, 1, 0]]
    assert torch.equal(truncate_at_first_eos(tokens, mask, torch.tensor([2, 7])), out)
    assert _rows(truncate_at_first_eos(tokens, mask, 7)) == _rows(mask[:3]) + [[1, 1, 1, 0]]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 4), st.booleans()), min_size=5, max_size=5), min_size=1, max_size=5))
def test_truncate_matches_naive_scan(rows):
    tokens = torch.tensor([[tok for tok, _ in row] for row in rows])
    mask = torch.tensor([[m for _, m in row] for row in rows])
    expected = []
    for row in rows:
        seen, out = False, []
        for tok, m in row:
            out.append(int(m and not seen))
            seen = seen or (m and tok in (0, 3))
        expected.append(out)
    assert _rows(truncate_at_first_eos(tokens, mask, (0, 3))) == expected


def test_truncate_errors():
    tokens, mask = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"eos_ids is empty"):
        truncate_at_first_eos(tokens, mask, [])
    with pytest.raises(TypeError, match=r"eos_ids: expected an int, got 2.5 of type float. Pass a token id"):
        truncate_at_first_eos(tokens, mask, 2.5)
    with pytest.raises(TypeError, match=r"eos_ids: expected an int, got True of type bool"):
        truncate_at_first_eos(tokens, mask, [2, True])
    with pytest.raises(TypeError, match=r"eos_ids"):
        truncate_at_first_eos(tokens, mask, torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"tokens must be \[B, T\] with the mask's shape \(2, 3\); got \(2, 4\)"):
        truncate_at_first_eos(torch.zeros(2, 4, dtype=torch.long), mask, 1)
    with pytest.raises(TypeError, match=r"mask must be a bool tensor"):
        truncate_at_first_eos(tokens, mask.long(), 1)


# ---------------------------------------------------------------- layouts


@pytest.mark.parametrize("side", ["left", "right"])
def test_round_trip_padded_nested_padded(side):
    """Rows of lengths 3, 0, 5 with a feature dimension; values and gradients come back."""
    lengths = torch.tensor([3, 0, 5])
    mask = mask_from_lengths(lengths, 6, padding_side=side)
    x = torch.randn(3, 6, 2, dtype=torch.float64, requires_grad=True)
    nested = padded_to_nested(x, mask)
    assert nested.layout == torch.jagged and nested.size(0) == 3
    back = nested_to_padded(nested, padding_side=side, total_length=6, padding_value=-7.0)
    assert isinstance(back, Padded) and torch.equal(back.mask, mask)
    assert torch.equal(back.values[mask], x[mask])
    assert (back.values[~mask] == -7.0).all()
    back.values.sum().backward()
    assert torch.equal(x.grad, mask[..., None].expand(3, 6, 2).double())


def test_sides_convert_into_each_other_and_default_length():
    """Right-padded -> nested -> left-padded equals building the left-padded batch directly;
    without total_length the width is the longest row (4 here)."""
    lengths = torch.tensor([2, 4, 1])
    tokens = torch.arange(1, 19).reshape(3, 6)
    right = mask_from_lengths(lengths, 6)
    nested = padded_to_nested(tokens, right)
    left = nested_to_padded(nested, padding_side="left")
    assert left.values.shape == (3, 4)
    assert left.values.tolist() == [[0, 0, 1, 2], [7, 8, 9, 10], [0, 0, 0, 13]]
    assert torch.equal(left.mask, mask_from_lengths(lengths, 4, padding_side="left"))


def test_non_contiguous_mask_is_compacted():
    x = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    mask = torch.tensor([[True, False, True, False], [False, False, False, True]])
    rows = padded_to_nested(x, mask).unbind()
    assert [r.tolist() for r in rows] == [[1, 3], [8]]


def test_strided_nested_and_jagged_with_holes_are_accepted():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strided = torch.nested.nested_tensor([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])])
    out = nested_to_padded(strided)
    assert out.values.tolist() == [[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]
    holes = torch.nested.nested_tensor_from_jagged(
        torch.arange(10.0), offsets=torch.tensor([0, 4, 8]), lengths=torch.tensor([2, 3])
    )
    out = nested_to_padded(holes, padding_side="left")
    assert out.values.tolist() == [[0.0, 0.0, 1.0], [4.0, 5.0, 6.0]]


def test_ragged_dim_after_a_singleton_dim_round_trips():
    """Rows shaped [1, n_b, 1] (per-step token rewards of a lazy stack) stack to a jagged
    [2, 1, j, 1] ragged at dim 2. Padding puts row b's entries at [b, 0, :n_b, 0]: rows
    [0, 1, 2] and [10, 11, 12, 13, 14] give [[0, 1, 2, 0, 0], [10, 11, 12, 13, 14]]
    (left: [[0, 0, 0, 1, 2], ...]), and padded_to_nested(ragged_dim=2) gives the rows back."""
    rows = [torch.arange(3.0).reshape(1, 3, 1), (10 + torch.arange(5.0)).reshape(1, 5, 1)]
    nested = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    assert nested.shape[:2] == (2, 1) and ragged_dim_of(nested) == 2
    right = nested_to_padded(nested)
    assert right.values.shape == (2, 1, 5, 1)
    assert right.values[:, 0, :, 0].tolist() == [[0, 1, 2, 0, 0], [10, 11, 12, 13, 14]]
    assert right.mask.tolist() == [[True] * 3 + [False] * 2, [True] * 5]
    left = nested_to_padded(nested, padding_side="left")
    assert left.values[0, 0, :, 0].tolist() == [0, 0, 0, 1, 2]
    back = padded_to_nested(right.values, right.mask, ragged_dim=2)
    assert ragged_dim_of(back) == 2
    assert all(torch.equal(a, b) for a, b in zip(back.unbind(), rows))


def test_layout_errors():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"x must have B = 2 at dim 0 and T = 3 at dim 1 .*; got \(2, 4\)"):
        padded_to_nested(torch.zeros(2, 4), mask)
    with pytest.raises(ValueError, match=r"ragged_dim: expected an int in \[1, \d+\], got 2"):
        padded_to_nested(torch.zeros(2, 3), mask, ragged_dim=2)
    with pytest.raises(TypeError, match=r"mask must be a bool tensor"):
        padded_to_nested(torch.zeros(2, 3), mask.long())
    with pytest.raises(TypeError, match=r"x must be a nested tensor"):
        nested_to_padded(torch.zeros(2, 3))
    nested = padded_to_nested(torch.zeros(2, 3), mask)
    with pytest.raises(ValueError, match=r"total_length=2 is shorter than the longest row \(3\)"):
        nested_to_padded(nested, total_length=2)
    with pytest.raises(ValueError, match=r"padding_side: expected one of .*, got 'top'"):
        nested_to_padded(nested, padding_side="top")
