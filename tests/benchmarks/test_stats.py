"""The docs' small statistics on hand-derived values."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _stats import interval, prediction, welch  # noqa: E402


def test_a_mean_s_interval_and_the_range_of_one_more_draw():
    """Values 41, 41, 47: mean 43, sd sqrt(((-2)^2 + (-2)^2 + 4^2) / 2) = sqrt(12) = 3.4641; t(2) =
    4.303. The mean's interval: 43 -+ 4.303 * 3.4641 / sqrt(3) = 43 -+ 8.606; one more draw:
    43 -+ 4.303 * 3.4641 * sqrt(4 / 3) = 43 -+ 17.212. One value has no spread: NaN bounds."""
    mean, low, high = interval([41.0, 41.0, 47.0])
    assert (mean, low, high) == pytest.approx((43.0, 43.0 - 8.606, 43.0 + 8.606), abs=1e-9)
    mean, low, high = prediction([41.0, 41.0, 47.0])
    assert (mean, low, high) == pytest.approx((43.0, 43.0 - 17.212, 43.0 + 17.212), abs=1e-9)
    assert prediction([5.0])[0] == 5.0 and all(math.isnan(v) for v in prediction([5.0])[1:])


def test_welch_adds_the_variances_on_satterthwaites_degrees_of_freedom():
    """Parts (0.04, 4) and (0.05, 9): variance 0.09, df 0.09^2 / (0.04^2 / 4 + 0.05^2 / 9)
    = 0.0081 / (0.0004 + 0.000277...) = 11.95, rounded down to 11: t = 2.201, half-width
    2.201 x 0.3 = 0.6603. A part with no degree of freedom gives no bounds; no variance, a point."""
    mean, low, high = welch(1.0, [(0.04, 4), (0.05, 9)])
    assert (mean, low, high) == pytest.approx((1.0, 1.0 - 0.6603, 1.0 + 0.6603), abs=1e-12)
    assert all(math.isnan(v) for v in welch(1.0, [(0.04, 4), (0.01, 0)])[1:])
    assert welch(2.0, [(0.0, 3), (0.0, 2)]) == (2.0, 2.0, 2.0)
