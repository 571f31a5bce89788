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


def test_the_curve_joins_the_constant_beta_means_extends_its_first_segment_and_stays_flat_beyond():
    """Knots: constant-0.3 at (0.5, 0.30), constant-0.1 at (1.5, 0.45): slope 0.15 a nat, so
    KL 1.0 reads 0.375 and KL 0 (before, the first segment extended) 0.225; KL 2.5 (beyond the
    last knot) reads the last knot's 0.45, not the extended line's 0.60."""
    knots = frontier_tables.curve(RECORDS)
    assert [v for knot in knots for v in knot] == pytest.approx([0.5, 0.30, 1.5, 0.45])
    for kl, accuracy in ((1.0, 0.375), (2.5, 0.45), (0.0, 0.225), (0.5, 0.30), (1.5, 0.45)):
        assert frontier_tables.on_curve(knots, kl) == pytest.approx(accuracy, abs=1e-12)
    with pytest.raises(ValueError, match="knots: expected at least two"):
        frontier_tables.on_curve(knots[:1], 1.0)


def test_a_variants_residual_is_its_runs_mean_over_the_curve_with_the_t_interval():
    """budget-t1 at KL 1.0 reads 0.40 and 0.42 against 0.375: residuals +2.5 and +4.5 points, mean
    +3.5, sd sqrt(2), t(1) = 12.706: 3.5 -+ 12.706 = -9.2 to +16.2; its gain over base +21.0."""
    table = frontier_tables.points_table(RECORDS, "full")
    row = next(line for line in table.splitlines() if line.startswith("| budget-t1 |"))
    assert "| +3.5 (-9.2 to +16.2) |" in row and "| 2 | 41.0 (28.3 to 53.7) | +21.0 (+8.3 to +33.7) |" in row
    # a seed without a base run has no gain, and the cell says how many seeds it pairs
    third = frontier_tables.points_table(RECORDS + [_record("budget-t1", 2, 1.0, 0.41)], "full")
    row = next(line for line in third.splitlines() if line.startswith("| budget-t1 |"))
    assert "| +21.0 (+8.3 to +33.7) (2 of 3 seeds: the others have no base run) |" in row
    assert next(line for line in table.splitlines() if line.startswith("| constant-0.1 |")).count("| – |") == 1
    assert [line.split(" | ")[0] for line in table.splitlines()[2:6]] == ["| base", "| constant-0.1", "| constant-0.3",
                                                                          "| budget-t1"]


def test_another_modes_records_are_not_shown_and_an_empty_mode_says_so():
    reduced = [dict(r, mode="reduced") for r in RECORDS]
    assert frontier_tables.points_table(reduced, "full").startswith("No full frontier runs recorded yet")
    assert "| budget-t1 | 2 |" in frontier_tables.points_table(reduced, "reduced")


def test_the_moving_reference_is_read_against_full_fine_tuning_and_a_landed_point_is_no_knot():
    """Full fine-tuning's curve: full-constant-0.3 at (0.5, 0.20), full-constant-0 at (2.0, 0.60),
    slope 0.4 / 1.5 a nat, so KL 1.25 reads 0.40; full-budget-moving-t1 reads 0.45 and 0.47 there:
    +5 and +7 points, mean +6.0, sd sqrt(2), t(1) = 12.706: -6.7 to +18.7. constant-0-land-t1 is
    no knot of LoRA's curve: at budget-t1's KL and accuracies its residual is budget-t1's +3.5."""
    full = [_record("full-constant-0.3", s, 0.5, 0.20) for s in (0, 1)] + [
        _record("full-constant-0", 0, 1.8, 0.60), _record("full-constant-0", 1, 2.2, 0.60),
        _record("full-budget-moving-t1", 0, 1.25, 0.45), _record("full-budget-moving-t1", 1, 1.25, 0.47),
        _record("constant-0-land-t1", 0, 1.0, 0.40), _record("constant-0-land-t1", 1, 1.0, 0.42)]
    assert frontier_tables.curve_family("full-budget-moving-t3") == "full-constant"
    assert frontier_tables.curve_family("budget-moving-t3") == "constant"  # with LoRA, on LoRA's curve
    assert frontier_tables.curve_family("constant-0-land-t3") == "constant"
    assert frontier_tables.curve_family("full-constant-0.1") is None
    # the 48-step runs have a curve of their own
    assert [frontier_tables.curve_family(p) for p in ("long-budget-t1", "long-budget-avg-t3", "long-budget-moving-t1",
                                                      "long-constant-0.1")] == [
        "long-constant", "long-constant", "long-constant", None]
    table = frontier_tables.points_table(RECORDS + full, "full").splitlines()
    row = {line.split(" | ")[0][2:]: line for line in table if line.startswith("| ")}
    assert "| +6.0 (-6.7 to +18.7) (full-constant) |" in row["full-budget-moving-t1"]
    assert "| +3.5 (-9.2 to +16.2) |" in row["constant-0-land-t1"] and "| +3.5 (-9.2 to +16.2) |" in row["budget-t1"]
    assert row["full-constant-0"].count("| – |") == 1  # a knot has no residual


def test_the_power_table_pools_the_variants_residual_spread_and_counts_the_seeds_it_needs():
    """budget-t1's residuals are +2.5 and +4.5 points (above): deviations -+1 from their mean, one
    degree of freedom, sd sqrt(2) = 1.414 points. Half-widths t95(n) sd / sqrt(n): n = 3 4.303 *
    1.414 / 1.732 = 3.5, n = 8 2.365 / 2 = 1.2, n = 16 2.131 * 1.414 / 4 = 0.8, n = 32 2.042 *
    1.414 / 5.657 = 0.5; 4 seeds give 3.182 * 1.414 / 2 = 2.25 > 2, 5 give 2.776 * 1.414 / 2.236
    = 1.76: 5 seeds. Best-of-n, the base model and a point of one seed add nothing to the spread."""
    extra = [_record("best-of-n-8", 0, 1.2, 0.10), _record("best-of-n-8", 1, 1.2, 0.90),
             _record("base", 2, 0.0, 0.90), _record("budget-t3", 0, 1.5, 0.99)]
    table = frontier_tables.power_table(RECORDS + extra)
    assert table.splitlines()[2] == "| full | 2 (1) | 1.4 | 3.5 / 1.2 / 0.8 / 0.5 | 5 |"
    assert len(table.splitlines()) == 3  # no reduced records: no row
    sd, df, runs = frontier_tables.residual_spread(RECORDS + extra)
    assert (df, runs) == (1, 2) and sd == pytest.approx(2 ** 0.5 / 100, rel=1e-12)
    assert frontier_tables.seeds_for(1.0, 1.0) == 7  # 2.571 / sqrt(6) = 1.050 > 1, 2.447 / sqrt(7) = 0.925
    assert frontier_tables.power_table(RECORDS[:4]).startswith("No variant has two seeds yet")


def test_the_residual_with_the_curves_noise_adds_each_knots_variance_by_its_weight():
    """budget-t1 at KL 1.0 sits halfway between the knots (0.5, 0.30) and (1.5, 0.45): weights 1/2
    and 1/2. Its residuals +2.5 and +4.5 points give a mean's variance of 0.0002 / 2 = 1e-4 (df 1);
    constant-0.3's accuracies 0.30, 0.30 add 0; constant-0.1's 0.40, 0.50 (variance of the mean
    0.005 / 2 = 0.0025, df 1) add 0.25 x 0.0025 = 6.25e-4. Sum 7.25e-4; Welch-Satterthwaite's df
    7.25e-4^2 / (1e-8 + 3.90625e-7) = 1.31, rounded down to 1: t = 12.706, half-width
    12.706 x sqrt(7.25e-4) = 0.34212: +3.5 (-30.7 to +37.7) in the table, after the seeds-only one."""
    runs = [r for r in RECORDS if r["point"] == "budget-t1"]
    mean, low, high = frontier_tables.residual_with_curve(runs, frontier_tables.curve_knots(RECORDS, "constant"))
    half = 12.706 * 7.25e-4 ** 0.5
    assert (mean, low, high) == pytest.approx((0.035, 0.035 - half, 0.035 + half), abs=1e-12)
    row = next(line for line in frontier_tables.points_table(RECORDS, "full").splitlines() if line.startswith("| budget-t1 |"))
    assert "| +3.5 (-9.2 to +16.2) | +3.5 (-30.7 to +37.7) |" in row


def test_beyond_the_last_knot_a_run_is_read_against_that_knot_alone():
    """budget-moving-t1 at KL 2.5, past the last knot (1.5, 0.45), reads 0.50 and 0.52: residuals +5
    and +7 points against 0.45 (the extended line would say 0.60), mean +6. With the curve's noise:
    the runs' variance of the mean 2e-4 / 2 = 1e-4 (df 1) plus constant-0.1's 0.0025 at weight 1
    (the line's weights -1 and 2 would have added 4 x 0.0025): 0.0026, Welch df 0.0026^2 / (1e-8 +
    6.25e-6) = 1.08, rounded down to 1: half-width 12.706 x sqrt(0.0026) = 0.64788."""
    runs = [_record("budget-moving-t1", 0, 2.5, 0.50), _record("budget-moving-t1", 1, 2.5, 0.52)]
    assert frontier_tables.residuals(runs, frontier_tables.curve(RECORDS)) == pytest.approx([0.05, 0.07], abs=1e-12)
    mean, low, high = frontier_tables.residual_with_curve(runs, frontier_tables.curve_knots(RECORDS, "constant"))
    half = 12.706 * 0.0026 ** 0.5
    assert (mean, low, high) == pytest.approx((0.06, 0.06 - half, 0.06 + half), abs=1e-12)


def test_the_residual_with_the_curves_noise_has_no_bounds_when_a_knot_has_one_seed():
    """Without constant-0.1's seed 1 its knot is (1.0, 0.40), one seed, and budget-t1 at KL 1.0 reads
    it alone (weight 1): residuals 0 and +2 points, mean +1. That knot has no spread to add, so the
    interval is not drawn (NaN bounds); the mean still is."""
    records = [r for r in RECORDS if not (r["point"] == "constant-0.1" and r["seed"] == 1)]
    runs = [r for r in records if r["point"] == "budget-t1"]
    mean, low, high = frontier_tables.residual_with_curve(runs, frontier_tables.curve_knots(records, "constant"))
    assert low != low and high != high and mean == pytest.approx(0.01, abs=1e-12)
