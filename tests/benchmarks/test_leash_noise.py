"""``benchmarks/leash_noise.py``'s ceilings on the in-band share, on batch KLs derived by hand."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from leash_noise import ceilings  # noqa: E402


def test_ceilings_of_three_batches():
    """Batch KLs 1, 1.2, 2 (band +-25 %): mean 1.4; over it 0.714, 0.857, 1.429, so one of three
    lies in [0.75, 1.25]. Ordered pairs (first, second), second / first: 1.2, 2, 0.833, 1.667,
    0.5, 0.6: two of six in the band. sd of log KL: logs 0, ln 1.2, ln 2 around their mean m,
    sqrt(sum (x - m)^2 / 2)."""
    got = ceilings([1.0, 1.2, 2.0])
    logs = [0.0, math.log(1.2), math.log(2.0)]
    m = sum(logs) / 3
    assert got["mean"] == pytest.approx(1.4, abs=1e-15)
    assert got["aimed_at_mean"] == pytest.approx(1 / 3, abs=1e-15)
    assert got["aimed_at_one_batch"] == pytest.approx(2 / 6, abs=1e-15)
    assert got["sd_log"] == pytest.approx(math.sqrt(sum((x - m) ** 2 for x in logs) / 2), rel=1e-12)


def test_pooled_batches_are_means_of_consecutive_runs():
    """Batch KLs 1, 3, 2, 4, 10 pooled by 2: (1+3)/2 = 2 and (2+4)/2 = 3; the fifth batch has no
    partner and is left out (a pooled batch is always k whole batches). Pooled by 1: unchanged."""
    from leash_noise import pooled

    assert pooled([1.0, 3.0, 2.0, 4.0, 10.0], 2) == [2.0, 3.0]
    assert pooled([1.0, 3.0, 2.0], 1) == [1.0, 3.0, 2.0]
