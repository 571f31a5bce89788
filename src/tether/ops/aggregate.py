"""The one reduction of per-token values to a scalar, shared by every loss and metric.

Modes (a registry, ``AGGREGATION_MODES``):

* ``token-mean``: sum over valid tokens / number of valid tokens (DAPO, verl default).
* ``seq-mean-token-mean``: mean over each row's valid tokens, then mean over rows
  (the GRPO paper).
* ``seq-mean-token-sum``: sum over each row's valid tokens, then mean over rows.
* ``seq-mean-token-sum-norm``: each row's sum divided by a constant ``normalizer`` (the
  maximal response length in Dr. GRPO), then mean over rows.

Rows without any valid token are left out of the sequence means (they neither add a zero
nor count in the denominator), and a batch with no valid token at all aggregates to 0.
Masked entries are replaced rather than multiplied by 0, so NaN or inf padding never
leaks into the result or its gradient.

``denominator`` replaces the outer count (tokens for ``token-mean``, sequences for the
other modes). Passing ``aggregate_denominator(full_mask, mode)`` to every micro-batch of a
batch makes the micro-batch results add up to the full-batch value, which plain
per-micro-batch means do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from tether.ops.checks import check_same_device, lookup, real_number


@dataclass(frozen=True)
class _Mode:
    # row_stat maps (values with masked entries zeroed, mask, normalizer) to [B] per-row
    # contributions; None means the numerator is the plain token sum.
    row_stat: Callable[[Tensor, Tensor, Tensor | float | None], Tensor] | None
    needs_normalizer: bool = False


def _row_mean(values: Tensor, mask: Tensor, normalizer: Tensor | float | None) -> Tensor:
    counts = mask.sum(dim=-1)
    return values.sum(dim=-1) / counts.clamp_min(1)


def _row_sum(values: Tensor, mask: Tensor, normalizer: Tensor | float | None) -> Tensor:
    return values.sum(dim=-1)


def _row_sum_norm(values: Tensor, mask: Tensor, normalizer: Tensor | float | None) -> Tensor:
    return values.sum(dim=-1) / normalizer


AGGREGATION_MODES: dict[str, _Mode] = {
    "token-mean": _Mode(row_stat=None),
    "seq-mean-token-mean": _Mode(row_stat=_row_mean),
    "seq-mean-token-sum": _Mode(row_stat=_row_sum),
    "seq-mean-token-sum-norm": _Mode(row_stat=_row_sum_norm, needs_normalizer=True),
}


def _mode(mode: str) -> _Mode:
    return lookup(AGGREGATION_MODES, mode, "mode")


def _check_mask(mask: Tensor) -> None:
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"mask must be a bool tensor [B, T]; got {got}. Use mask.bool() or mask > 0.")
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [B, T]; got shape {tuple(mask.shape)}.")


def _check_positive(name: str, value: Tensor | float | None) -> None:
    if value is None:
        return
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise TypeError(
                f"{name}: expected a one-element real tensor or a number, got a {value.dtype} "
                f"tensor of shape {tuple(value.shape)}. Pass aggregate_denominator(mask, mode)."
            )
        return
    real_number(name, value, low=0, low_open=True, fix="Pass the positive count or length it stands for.")


def aggregate_denominator(mask: Tensor, mode: str) -> Tensor:
    """The outer count of ``mode`` for a (micro-)batch.

    Args:
        mask: ``bool [B, T]`` valid tokens.
        mode: a key of ``AGGREGATION_MODES``.

    Returns:
        Scalar ``int64`` tensor: the number of valid tokens for ``token-mean``, the number
        of rows with at least one valid token for the sequence modes.
    """
    spec = _mode(mode)
    _check_mask(mask)
    if spec.row_stat is None:
        return mask.sum()
    return mask.any(dim=-1).sum()


def check_aggregation(mode: str, normalizer: Tensor | float | None, *, argument: str = "mode") -> _Mode:
    """The mode's spec after checking it and its normalizer as ``aggregate`` does (a loss checks its
    options with it); ``argument`` is the caller's name for the mode, which the errors name."""
    spec = lookup(AGGREGATION_MODES, mode, argument)
    if spec.needs_normalizer and normalizer is None:
        raise ValueError(
            f"{argument}={mode!r} needs normalizer (a constant per-row divisor such as the maximal "
            "response length); pass normalizer=<positive number>."
        )
    _check_positive("normalizer", normalizer)
    return spec


def _check_arguments(values: Tensor, mask: Tensor, mode: str, normalizer, denominator) -> _Mode:
    """The mode's spec, after every argument check of ``aggregate`` (typed errors naming them)."""
    spec = check_aggregation(mode, normalizer)
    _check_mask(mask)
    if not isinstance(values, Tensor) or values.shape != mask.shape:
        got = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise ValueError(f"values must be a tensor with the mask's shape {tuple(mask.shape)}; got {got}.")
    check_same_device("mask", mask, "values", values)
    _check_positive("denominator", denominator)
    return spec


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    normalizer: Tensor | float | None = None,
    denominator: Tensor | float | None = None,
) -> Tensor:
    """Reduce per-token ``values`` over the valid tokens of ``mask`` to a scalar.

    Args:
        values: ``[B, T]`` per-token values (loss, KL, clip indicator, entropy...).
        mask: ``bool [B, T]`` valid tokens.
        mode: a key of ``AGGREGATION_MODES`` (see the module docstring).
        normalizer: the constant per-row divisor of ``seq-mean-token-sum-norm`` (required
            there, ignored elsewhere); > 0.
        denominator: replaces the outer count (see ``aggregate_denominator``); default is
            this batch's own count. A number must be > 0 (else ``ValueError``). A
            one-element tensor is not read back to the host: 0 gives 0 when this batch has
            nothing to add (the empty batch), any other count <= 0 gives NaN.

    Returns:
        Scalar tensor in the dtype of ``values`` (bool and integer values, e.g. a clip
        indicator, are promoted to the default float dtype); 0 when no token is valid.
        The sums run on the kept values divided by a power of two (``_power_of_two_scale``),
        which is exact, so the result is finite wherever the exact one is representable in
        the dtype (float32 values near 1e38 whose sum overflows) and otherwise bit-equal to the
        plain sum divided by the count.

    Worked check: loss 1 on a length-2 row and 2 on a length-4 row (``T = 4``) gives
    10/6 (token-mean), 1.5 (seq-mean-token-mean), 5 (seq-mean-token-sum) and 1.25
    (seq-mean-token-sum-norm, normalizer 4).
    """
    spec = _check_arguments(values, mask, mode, normalizer, denominator)
    if not values.is_floating_point():
        values = values.to(torch.get_default_dtype())
    kept = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    scale = _power_of_two_scale(kept)
    kept = kept / scale
    if spec.row_stat is None:
        numerator = kept.sum()
    else:
        numerator = spec.row_stat(kept, mask, normalizer).sum()
    if denominator is None:
        denominator = aggregate_denominator(mask, mode)
    count = torch.as_tensor(denominator, device=values.device)
    # A count of 0 is an empty (micro-)batch: its numerator is 0 and so is the result. A
    # tensor count is not read back (no host sync), so a count <= 0 with something to
    # divide gives NaN instead of a plausible number.
    positive = count > 0
    result = numerator / torch.where(positive, count, torch.ones_like(count)).to(numerator.dtype) * scale
    valid_empty = (count == 0) & (numerator == 0)
    result = torch.where(positive | valid_empty, result, torch.full_like(result, float("nan")))
    return result


def _power_of_two_scale(kept: Tensor) -> Tensor:
    """A power of two ``>= 1`` that brings the largest finite ``|kept|`` below 2: dividing by it and
    multiplying back are exact (the values are never scaled up, so none becomes subnormal), and the
    sum of ``N`` scaled values stays below ``2N``. Detached and 1 when every value is 0 or not finite."""
    finite = torch.where(torch.isfinite(kept), kept.detach().abs(), torch.zeros((), dtype=kept.dtype,
                                                                             device=kept.device))
    largest = finite.amax() if finite.numel() else torch.zeros((), dtype=kept.dtype, device=kept.device)
    exponent = torch.frexp(largest.float() if largest.dtype in (torch.float16, torch.bfloat16) else largest).exponent
    return torch.ldexp(torch.ones((), dtype=kept.dtype, device=kept.device), (exponent - 1).clamp_min(0).to(kept.dtype))
