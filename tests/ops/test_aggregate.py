"""aggregate / aggregate_denominator: worked values, empty rows, padding, micro-batch additivity."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.ops import AGGREGATION_MODES, aggregate, aggregate_denominator, kl_loss_term

F64 = torch.float64
MODES = list(AGGREGATION_MODES)
NORM = 4.0


def _kwargs(mode: str) -> dict:
    return {"normalizer": NORM} if mode == "seq-mean-token-sum-norm" else {}


def _naive(values: torch.Tensor, mask: torch.Tensor, mode: str) -> float:
    """Plain-Python reference: loops over rows and tokens."""
    rows = []
    total, count = 0.0, 0
    for b in range(values.shape[0]):
        kept = [float(v) for v, m in zip(values[b], mask[b]) if m]
        total += sum(kept)
        count += len(kept)
        if kept:
            rows.append(kept)
    if mode == "token-mean":
        return total / count if count else 0.0
    if not rows:
        return 0.0
    per_row = {
        "seq-mean-token-mean": lambda r: sum(r) / len(r),
        "seq-mean-token-sum": sum,
        "seq-mean-token-sum-norm": lambda r: sum(r) / NORM,
    }[mode]
    return sum(per_row(r) for r in rows) / len(rows)


def _spec_batch():
    values = torch.tensor([[1.0, 1.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]], dtype=F64)
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    return values, mask


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", 10.0 / 6.0),
        ("seq-mean-token-mean", 1.5),
        ("seq-mean-token-sum", 5.0),
        ("seq-mean-token-sum-norm", 1.25),
    ],
)
def test_spec_worked_values(mode, expected):
    """SPEC: loss 1 on a length-2 row, 2 on a length-4 row, T = 4.
    token-mean (2 + 8) / 6; seq-mean-token-mean (1 + 2) / 2; seq-mean-token-sum (2 + 8) / 2;
    seq-mean-token-sum-norm (2/4 + 8/4) / 2."""
    values, mask = _spec_batch()
    assert aggregate(values, mask, mode, **_kwargs(mode)).item() == pytest.approx(expected, abs=1e-15)
    assert aggregate(values, mask, mode, **_kwargs(mode)).item() == pytest.approx(round(expected, 6), abs=5e-7)


def test_empty_rows_are_left_out_of_sequence_means():
    """Rows [3, 1 | -], [- | -] (empty), [2 | -]: token-mean 6/3 = 2; the empty row is not a
    sequence, so seq-mean-token-mean (2 + 2) / 2 = 2, seq-mean-token-sum (4 + 2) / 2 = 3,
    sum-norm (4/4 + 2/4) / 2 = 0.75; denominators 3 tokens and 2 sequences."""
    values = torch.tensor([[3.0, 1.0], [5.0, 7.0], [2.0, 9.0]], dtype=F64)
    mask = torch.tensor([[True, True], [False, False], [True, False]])
    expected = {
        "token-mean": 2.0,
        "seq-mean-token-mean": 2.0,
        "seq-mean-token-sum": 3.0,
        "seq-mean-token-sum-norm": 0.75,
    }
    for mode, value in expected.items():
        assert aggregate(values, mask, mode, **_kwargs(mode)).item() == pytest.approx(value, abs=1e-15)
    assert aggregate_denominator(mask, "token-mean").item() == 3
    for mode in MODES[1:]:
        assert aggregate_denominator(mask, mode).item() == 2


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_batch_gives_zero_and_zero_gradient(mode):
    values = torch.full((2, 3), float("nan"), dtype=F64, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    out = aggregate(values, mask, mode, **_kwargs(mode))
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(values.grad, torch.zeros(2, 3, dtype=F64))


@pytest.mark.parametrize("mode", MODES)
def test_padding_never_leaks_and_extra_padding_changes_nothing(mode):
    """Appending masked columns full of inf/NaN leaves value and gradient unchanged; the
    per-token KL term computed on garbage padding is masked out the same way."""
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(3, 4, generator=gen, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    base = aggregate(values, mask, mode, **_kwargs(mode))
    (grad,) = torch.autograd.grad(base, values)

    junk = torch.tensor([[float("inf"), float("nan")]] * 3, dtype=F64)
    wide = torch.cat([values, junk], dim=1)
    wide_mask = torch.cat([mask, torch.zeros(3, 2, dtype=torch.bool)], dim=1)
    out = aggregate(wide, wide_mask, mode, **_kwargs(mode))
    (wide_grad,) = torch.autograd.grad(out, values)
    assert out.item() == pytest.approx(base.item(), abs=1e-14)
    torch.testing.assert_close(wide_grad, grad, rtol=0, atol=1e-15)

    logp = torch.cat([values, torch.full((3, 2), -1e4, dtype=F64)], dim=1)
    ref = torch.cat([values.detach() - 0.5, torch.full((3, 2), 1e4, dtype=F64)], dim=1)
    kl = aggregate(kl_loss_term(logp, ref), wide_mask, mode, **_kwargs(mode))
    (kl_grad,) = torch.autograd.grad(kl, values)
    assert torch.isfinite(kl) and torch.isfinite(kl_grad).all()


def test_bool_values_give_fractions():
    """Clip indicators: 2 of 3 valid tokens clipped -> token-mean 2/3."""
    clipped = torch.tensor([[True, False, True], [True, True, False]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert aggregate(clipped, mask).item() == pytest.approx(2 / 3)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.tuples(st.floats(-5, 5), st.booleans()), min_size=5, max_size=5), min_size=1, max_size=6),
    st.sampled_from(MODES),
)
def test_matches_naive_reference(rows, mode):
    values = torch.tensor([[v for v, _ in row] for row in rows], dtype=F64)
    mask = torch.tensor([[m for _, m in row] for row in rows])
    got = aggregate(values, mask, mode, **_kwargs(mode)).item()
    assert got == pytest.approx(_naive(values, mask, mode), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", [[8], [1] * 8, [4, 4], [3, 5]])
def test_micro_batches_add_up_to_full_batch(mode, split):
    """With the full batch's denominator, micro-batch aggregates (and their gradients)
    sum to the full-batch aggregate, including an empty row."""
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(8, 6, generator=gen, dtype=F64, requires_grad=True)
    lengths = torch.tensor([6, 3, 0, 1, 5, 2, 6, 4])
    mask = torch.arange(6) < lengths[:, None]
    full = aggregate(values, mask, mode, **_kwargs(mode))
    (full_grad,) = torch.autograd.grad(full, values)

    denominator = aggregate_denominator(mask, mode)
    parts = [
        aggregate(v, m, mode, denominator=denominator, **_kwargs(mode))
        for v, m in zip(values.split(split), mask.split(split))
    ]
    total = torch.stack(parts).sum()
    (grad,) = torch.autograd.grad(total, values)
    torch.testing.assert_close(total, full, rtol=1e-14, atol=0)
    torch.testing.assert_close(grad, full_grad, rtol=1e-14, atol=0)


def test_plain_micro_batch_means_do_not_add_up():
    """Why denominator exists: halves of the SPEC batch averaged separately give 1 + 2 = 3
    (token-mean) instead of 10/6."""
    values, mask = _spec_batch()
    halves = sum(aggregate(v, m) for v, m in zip(values.split(1), mask.split(1)))
    assert halves.item() == pytest.approx(3.0)
    assert aggregate(values, mask).item() == pytest.approx(10 / 6)


def test_denominator_accepts_numbers_and_empty_microbatch_gives_zero():
    values, mask = _spec_batch()
    assert aggregate(values, mask, denominator=5).item() == pytest.approx(2.0)
    empty = torch.zeros(1, 4, dtype=torch.bool)
    assert aggregate(values[:1], empty, denominator=torch.tensor(0)).item() == 0.0


def test_errors():
    values, mask = _spec_batch()
    with pytest.raises(ValueError, match=r"mode: expected one of .*'token-mean', 'seq-mean-token-mean'.*, got 'mean'"):
        aggregate(values, mask, "mean")
    with pytest.raises(ValueError, match=r"mode: expected one of .*, got 'mean'"):
        aggregate_denominator(mask, "mean")
    with pytest.raises(ValueError, match=r"needs normalizer"):
        aggregate(values, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match=r"normalizer: expected a finite number > 0, got 0"):
        aggregate(values, mask, "seq-mean-token-sum-norm", normalizer=0)
    with pytest.raises(TypeError, match=r"normalizer: expected a finite number > 0, got .* of type"):
        aggregate(values, mask, "seq-mean-token-sum-norm", normalizer="4")
    with pytest.raises(ValueError, match=r"denominator: expected a finite number > 0"):
        aggregate(values, mask, denominator=-1)
    with pytest.raises(TypeError, match=r"mask must be a bool tensor.*torch.float64"):
        aggregate(values, mask.to(F64))
    with pytest.raises(ValueError, match=r"mask must be 2-D"):
        aggregate(values[0], mask[0])
    with pytest.raises(ValueError, match=r"values must be a tensor with the mask's shape \(2, 4\); got \(2, 3\)"):
        aggregate(values[:, :3], mask)


# ------------------------------------------------------------------------------ issue 43, item 7: range
F32_MAX = float(torch.finfo(torch.float32).max)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.floats(-F32_MAX, F32_MAX, width=32), st.booleans()), min_size=4, max_size=4),
                min_size=1, max_size=4),
       st.sampled_from(MODES))
def test_float32_results_are_finite_wherever_the_exact_one_is_representable(rows, mode):
    """float32 values anywhere in float32's range: wherever the exact result (Python floats, float64
    by hand, the naive reference) is representable in float32 (here: |result| <= max / 2, away from
    the rounding edge), aggregate gives it to float32's rounding, never inf. A plain float32 sum
    overflows first: two values of 1.1e38 already sum past 3.4e38."""
    values = torch.tensor([[v for v, _ in row] for row in rows], dtype=torch.float32)
    mask = torch.tensor([[m for _, m in row] for row in rows])
    exact = _naive(values.double(), mask, mode)
    got = aggregate(values, mask, mode, **_kwargs(mode))
    if abs(exact) <= F32_MAX / 2:
        assert torch.isfinite(got), (exact, got)
        assert float(got) == pytest.approx(exact, rel=1e-6, abs=1e-30 + 1e-6 * max(abs(v) for r in rows for v, _ in r))


def test_values_near_the_float32_limit_keep_their_mean_and_gradient():
    """Every token 1.1e38 (float32, 2x3 valid): each mode's exact value is 1.1e38 (3.3e38 per row
    for seq-mean-token-sum, still below 3.403e38); the gradient of token-mean is 1/6 per token,
    as for small values. Before: inf (the six-token sum is 6.6e38)."""
    values = torch.full((2, 3), 1.1e38, requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    for mode, want in (("token-mean", 1.1e38), ("seq-mean-token-mean", 1.1e38), ("seq-mean-token-sum", 3.3e38),
                       ("seq-mean-token-sum-norm", 1.1e38 * 3 / NORM)):
        assert float(aggregate(values, mask, mode, **_kwargs(mode)).detach()) == pytest.approx(want, rel=1e-6), mode
    aggregate(values, mask).backward()
    assert torch.equal(values.grad, torch.full((2, 3), 1 / 6))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=6, max_size=6), st.sampled_from(MODES))
def test_the_scaling_leaves_ordinary_values_bit_equal(flat, mode):
    """Away from the limits the exact power-of-two scaling changes no bit: the result equals the
    plain float32 reduction (sum of the kept values, divided by the count) exactly."""
    values = torch.tensor(flat, dtype=torch.float32).reshape(2, 3)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    kept = torch.where(mask, values, 0.0)
    plain = {"token-mean": kept.sum() / 5, "seq-mean-token-mean": (kept.sum(-1) / mask.sum(-1)).sum() / 2,
             "seq-mean-token-sum": kept.sum(-1).sum() / 2, "seq-mean-token-sum-norm": (kept.sum(-1) / NORM).sum() / 2}
    assert torch.equal(aggregate(values, mask, mode, **_kwargs(mode)), plain[mode])
