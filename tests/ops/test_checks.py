"""The one scalar-argument check: its words, its types, its edges (NaN, infinities, bools, bounds)."""

from __future__ import annotations

import math

import pytest
import torch

from tether.ops.checks import kl_coefficient, lookup, problems, real_number, whole_number


def test_messages_name_the_argument_the_range_what_came_and_the_fix():
    with pytest.raises(ValueError) as err:
        real_number("top_p", 1.5, low=0, low_open=True, high=1, fix="Use None to keep every token.")
    assert str(err.value) == "top_p: expected a finite number in (0, 1], got 1.5. Use None to keep every token."
    with pytest.raises(TypeError) as err:
        whole_number("steps", "3", low=1)
    assert str(err.value) == "steps: expected an int >= 1, got '3' of type str."
    with pytest.raises(ValueError) as err:
        real_number("clip_epsilon low", 1.0, low=0, high=1, high_open=True)
    assert str(err.value) == "clip_epsilon low: expected a finite number in [0, 1), got 1.0."
    with pytest.raises(ValueError) as err:
        lookup({"a": 1, "b": 2}, "c", "mode")
    assert str(err.value) == "mode: expected one of 'a', 'b', got 'c'."


@pytest.mark.parametrize("value, kind", [
    (True, TypeError),            # a bool is a flag, never a number
    (math.nan, ValueError),       # NaN fails every range, even an open one
    (math.inf, ValueError),       # finite unless allow_inf
    (-math.inf, ValueError),
    (-1e-300, ValueError),        # just below an inclusive 0
    (torch.tensor(0.5), TypeError),  # tensors only with tensor_ok
])
def test_real_number_refuses(value, kind):
    with pytest.raises(kind, match="^x: expected a finite number >= 0, got "):
        real_number("x", value, low=0)


def test_bounds_open_and_closed_and_infinity_where_allowed():
    assert real_number("x", 0, low=0) == 0.0 and isinstance(real_number("x", 0, low=0), float)
    with pytest.raises(ValueError, match=r"^x: expected a finite number > 0, got 0\.$"):
        real_number("x", 0, low=0, low_open=True)
    assert real_number("x", 1, high=1) == 1.0
    with pytest.raises(ValueError, match=r"^x: expected a finite number < 1, got 1\.$"):
        real_number("x", 1, high=1, high_open=True)
    assert real_number("g", math.inf, low=1, low_open=True, allow_inf=True) == math.inf
    with pytest.raises(ValueError, match=r"^g: expected a number > 1, got nan\.$"):
        real_number("g", math.nan, low=1, low_open=True, allow_inf=True)


def test_whole_number_takes_integral_values_only():
    assert whole_number("n", 3, low=1, high=3) == 3
    for bad in (2.0, True, None):
        with pytest.raises(TypeError, match=r"^n: expected an int in \[1, 3\], got "):
            whole_number("n", bad, low=1, high=3)
    for bad in (0, 4):
        with pytest.raises(ValueError, match=rf"^n: expected an int in \[1, 3\], got {bad}\.$"):
            whole_number("n", bad, low=1, high=3)


def test_kl_coefficient_takes_a_one_element_tensor_and_refuses_a_negative_beta():
    assert kl_coefficient("coef", torch.tensor([0.25])) == 0.25
    assert kl_coefficient("coef", torch.tensor(2)) == 2.0
    with pytest.raises(ValueError, match=r"^coef: expected a finite number >= 0, got -0\.1\. A negative"):
        kl_coefficient("coef", -0.1)
    with pytest.raises(TypeError, match=r"^coef: expected a finite number >= 0, got tensor"):
        kl_coefficient("coef", torch.ones(2))


def test_problems_lists_the_error_instead_of_raising_it():
    assert problems(whole_number, "steps", 0, low=1) == ["steps: expected an int >= 1, got 0."]
    assert problems(real_number, "lr", 1e-3, low=0, low_open=True) == []
