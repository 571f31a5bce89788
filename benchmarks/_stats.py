"""The small statistics the docs' tables share: a mean with its 95 % Student t interval."""

from __future__ import annotations

import math
import statistics


def t95(n: int) -> float:
    """The two-sided 95 % Student t quantile with ``n - 1`` degrees of freedom (n = 2 .. 31; 31 beyond)."""
    table = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
             2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
             2.045, 2.042]
    return table[min(n, 31) - 2]


def _t_range(values: list[float], width: float) -> tuple[float, float, float]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = t95(len(values)) * statistics.stdev(values) * width
    return mean, mean - half, mean + half


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and its 95 % t interval (NaN bounds from one value)."""
    return _t_range(values, 1 / math.sqrt(len(values)))


def prediction(values: list[float]) -> tuple[float, float, float]:
    """Mean and the 95 % t range where one more draw from the same spread falls: ``mean -+ t sd
    sqrt(1 + 1 / n)`` (NaN bounds from one value)."""
    return _t_range(values, math.sqrt(1 + 1 / len(values)))


def welch(mean: float, parts: list[tuple[float, int]]) -> tuple[float, float, float]:
    """``mean`` with the 95 % t interval of a sum of independent estimates, each given as ``(variance,
    degrees of freedom)``: the variances add, on Welch-Satterthwaite's degrees of freedom rounded
    down. NaN bounds when a part has no degree of freedom."""
    if any(df < 1 for _, df in parts):
        return mean, math.nan, math.nan
    variance = sum(v for v, _ in parts)
    if variance == 0:
        return mean, mean, mean
    df = variance**2 / sum(v * v / d for v, d in parts)
    half = t95(int(df) + 1) * math.sqrt(variance)
    return mean, mean - half, mean + half
