"""Scalar argument checks: the one place every layer validates a number it was given.

Each check names the argument, says what it expected and what came, and may add how to fix it,
always in the words ``"{name}: expected {what}, got {value!r}. {fix}"``. A value of the wrong
type raises ``TypeError``; a number of the right type outside its range (NaN and infinities
included, unless allowed) raises ``ValueError``. ``bool`` is never taken for a number.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["kl_coefficient", "problems", "real_number", "whole_number"]


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high:g}"
    return ""


def _fail(kind: type[Exception], name: str, what: str, got: str, fix: str) -> Exception:
    return kind(f"{name}: expected {what}, got {got}." + (f" {fix}" if fix else ""))


def real_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False, allow_inf: bool = False,
                tensor_ok: bool = False, fix: str = "") -> float:
    """``value`` as a Python float inside the given range.

    Args:
        name: the argument's name, as the caller knows it.
        value: what came.
        low, high: bounds of the range (None: unbounded on that side).
        low_open, high_open: exclude the bound itself.
        allow_inf: accept an infinity the range allows (NaN is never accepted).
        tensor_ok: accept a one-element tensor (e.g. a coefficient held as a buffer).
        fix: a sentence appended to the error saying how to fix the call.
    """
    what = ("a number" if allow_inf else "a finite number") + _bounds(low, high, low_open, high_open)
    if tensor_ok and isinstance(value, Tensor) and value.numel() == 1 and value.dtype != torch.bool:
        value = float(value.detach())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(TypeError, name, what, f"{value!r} of type {type(value).__name__}", fix)
    number = float(value)
    inside = not math.isnan(number) and (allow_inf or math.isfinite(number))
    if low is not None:
        inside = inside and (number > low if low_open else number >= low)
    if high is not None:
        inside = inside and (number < high if high_open else number <= high)
    if not inside:
        raise _fail(ValueError, name, what, f"{value!r}", fix)
    return number


def whole_number(name: str, value: Any, *, low: int | None = None, high: int | None = None,
                 fix: str = "") -> int:
    """``value`` as a Python int in ``[low, high]`` (an integral number; floats such as ``2.0`` are refused).

    Args:
        name: the argument's name, as the caller knows it.
        value: what came.
        low, high: the smallest and largest accepted values (None: unbounded on that side).
        fix: a sentence appended to the error saying how to fix the call.
    """
    what = "an int" + _bounds(low, high, False, False)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(TypeError, name, what, f"{value!r} of type {type(value).__name__}", fix)
    if (low is not None and value < low) or (high is not None and value > high):
        raise _fail(ValueError, name, what, f"{value!r}", fix)
    return int(value)


def kl_coefficient(name: str, value: Any) -> float:
    """A KL coefficient (beta): finite and >= 0, a number or a one-element tensor."""
    return real_number(name, value, low=0, tensor_ok=True,
                       fix="A negative coefficient would reward drifting away from the reference.")


def problems(check: Callable[..., Any], name: str, value: Any, **bounds: Any) -> list[str]:
    """``check(name, value, **bounds)``'s error as a one-item list, empty when it passes: for
    validators that list every bad field at once (``TrainConfig.validate``)."""
    try:
        check(name, value, **bounds)
    except (TypeError, ValueError) as exc:
        return [str(exc)]
    return []
