"""The frontier page's numbers on hand-made records: the constant-beta curve through the points'
means, a variant's residual against it with its t interval, and the page's empty state."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import frontier_tables  # noqa: E402


def _record(point: str, seed: int, kl: float, accuracy: float, mode: str = "full") -> dict:
    return {"point": point, "seed": seed, "heldout_kl_sampled_per_seq": kl, "heldout_accuracy": accuracy,
            "forgetting_kl_sampled_per_seq": 0.5, "capability_rate": 0.5, "mode": mode, "device": "cpu",
            "dtype": "float32", "commit": "abc", "date": "2026-11-28", "model": "default", "eval_size": 4,
            "chat_prompts": 8}


RECORDS = [_record("constant-0.1", 0, 1.0, 0.40), _record("constant-0.1", 1, 2.0, 0.50),
           _record("constant-0.3", 0, 0.4, 0.30), _record("constant-0.3", 1, 0.6, 0.30),
           _record("budget-t1", 0, 1.0, 0.40), _record("budget-t1", 1, 1.0, 0.42),
           _record("base", 0, 0.0, 0.20), _record("base", 1, 0.0, 0.20)]


def test_the_curve_joins_the_constant_beta_means_and_extends_its_end_segments():
    """Knots: constant-0.3 at (0.5, 0.30), constant-0.1 at (1.5, 0.45): slope 0.15 a nat, so
    KL 1.0 reads 0.375, KL 2.5 (beyond) 0.60, KL 0 (before) 0.225."""
    knots = frontier_tables.curve(RECORDS)
    assert [v for knot in knots for v in knot] == pytest.approx([0.5, 0.30, 1.5, 0.45])
    for kl, accuracy in ((1.0, 0.375), (2.5, 0.60), (0.0, 0.225), (0.5, 0.30)):
        assert frontier_tables.on_curve(knots, kl) == pytest.approx(accuracy, abs=1e-12)
    with pytest.raises(ValueError, match="knots: expected at least two"):
        frontier_tables.on_curve(knots[:1], 1.0)


def test_a_variants_residual_is_its_runs_mean_over_the_curve_with_the_t_interval():
    """budget-t1 at KL 1.0 reads 0.40 and 0.42 against 0.375: residuals +2.5 and +4.5 points, mean
    +3.5, sd sqrt(2), t(1) = 12.706: 3.5 -+ 12.706 = -9.2 to +16.2; its gain over base +21.0."""
    table = frontier_tables.points_table(RECORDS, "full")
    row = next(line for line in table.splitlines() if line.startswith("| budget-t1 |"))
    assert "| +3.5 (-9.2 to +16.2) |" in row and "| 2 | 41.0 (28.3 to 53.7) | +21.0 (+8.3 to +33.7) |" in row
    assert next(line for line in table.splitlines() if line.startswith("| constant-0.1 |")).count("| – |") == 1
    assert [line.split(" | ")[0] for line in table.splitlines()[2:6]] == ["| base", "| constant-0.1", "| constant-0.3",
                                                                          "| budget-t1"]


def test_another_modes_records_are_not_shown_and_an_empty_mode_says_so():
    reduced = [dict(r, mode="reduced") for r in RECORDS]
    assert frontier_tables.points_table(reduced, "full").startswith("No full frontier runs recorded yet")
    assert "| budget-t1 | 2 |" in frontier_tables.points_table(reduced, "reduced")
