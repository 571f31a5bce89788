"""``BudgetKLController``: the search of the move on synthetic KL curves, its guarantee, the
beta rule, state and argument errors. The weights and the language model are in
``tests/models/test_reference_line.py`` and ``tests/train/test_kl_budget.py``."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.control import BudgetKLController, make_kl_controller
from tether.control.budget import pull_under_ceiling


class Plant:
    """A ``Line`` and its ``measure``: ``kl(s)`` at the scale last placed (1 until moved); a
    rejection returns to the step's start, whose KL is ``start_kl``."""

    def __init__(self, kl, start_kl: float = 0.5):
        self.kl, self.start_kl, self.scale, self.moves, self.reads, self.captures = kl, start_kl, 1.0, [], 0, 0
        self.rejected, self.full_reads = False, 0

    def capture(self) -> None:
        self.captures += 1

    def place(self, scale: float) -> None:
        self.scale = scale
        self.moves.append(scale)

    def reject(self) -> None:
        self.rejected, self.scale = True, 1.0

    def measure(self, full: bool = False) -> float:
        self.reads += 1
        self.full_reads += full
        return self.start_kl * self.scale ** 2 if self.rejected else self.kl(self.scale)

    def hold(self, ctl: BudgetKLController, **kw):
        return ctl.hold(self, self.measure, **kw)


def _ctl(**kw) -> BudgetKLController:
    return BudgetKLController(**{"init_kl_coef": 0.1, "target": 2.0, "push": True, **kw})


@pytest.mark.parametrize("kl_at_one", [1.6, 2.0, 2.24])
def test_weights_in_the_band_are_never_moved(kl_at_one):
    """Between 0.75 and 1.125 times the target the updated weights stay: one reading, no move."""
    plant = Plant(lambda s: kl_at_one * s * s)
    move = plant.hold(_ctl())
    assert (plant.moves, plant.reads, move.scale, move.forwards) == ([], 1, 1.0, 1)
    assert move.kl_before == move.kl_kept == kl_at_one and not move.rejected
    assert plant.captures == 0  # no copy of the weights when nothing moves


def test_a_quadratic_kl_is_pulled_back_with_one_more_forward():
    """KL = 8 s^2 at target 2: the first guess s = (2 / 8)^(1/2) = 0.5 lands exactly on 2; the
    kept weights are then read over every answer (a third reading, ``full=True``)."""
    plant = Plant(lambda s: 8.0 * s * s)
    move = plant.hold(_ctl())
    assert plant.moves == [0.5] and move.scale == 0.5 and move.forwards == 3
    assert move.kl_kept == pytest.approx(2.0, abs=1e-12) and plant.full_reads == 2 and plant.captures == 1


def test_a_lagging_kl_is_pushed_out_to_at_most_max_scale():
    """KL = 0.02 s^2: the guess 10 is cut to max_scale 4, where the KL is 0.32; nothing further
    is tried (4 was measured and is still under the target)."""
    plant = Plant(lambda s: 0.02 * s * s)
    move = plant.hold(_ctl())
    assert plant.moves == [4.0] and move.scale == 4.0 and move.kl_kept == pytest.approx(0.32)
    assert plant.reads == 3


def test_the_push_is_off_by_default():
    """A KL lagging far under the band: without push (the default) the weights stay, one reading."""
    plant = Plant(lambda s: 0.02 * s * s)
    move = plant.hold(BudgetKLController(init_kl_coef=0.1, target=2.0))
    assert (move.scale, move.forwards, plant.moves, plant.captures) == (1.0, 1, [], 0)


def test_max_scale_one_never_pushes():
    plant = Plant(lambda s: 0.02 * s * s)
    assert plant.hold(_ctl(push=False)).scale == 1.0 and plant.moves == []


def test_the_exponent_is_refitted_from_two_readings():
    """KL = 8 s^4: the quadratic guess 0.5 reads 0.5; the refit exponent is log(0.5/8)/log(0.5) = 4,
    so the next guess 0.5 * (2 / 0.5)^(1/4) = 0.7071 lands on 2 (to rounding)."""
    plant = Plant(lambda s: 8.0 * s ** 4)
    ctl = _ctl()
    move = plant.hold(ctl)
    assert plant.moves[0] == 0.5 and plant.moves[1] == pytest.approx(math.sqrt(0.5), rel=1e-12)
    assert ctl.power == pytest.approx(4.0) and move.kl_kept == pytest.approx(2.0, rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(scale=st.floats(0.05, 50.0), power=st.floats(0.3, 6.0), wiggle=st.floats(0.0, 0.9),
       forwards=st.integers(2, 6))
def test_kept_weights_are_under_the_top_or_the_update_is_rejected(scale, power, wiggle, forwards):
    """Whatever the curve (non-monotone wiggles included): a move keeps the weights of the last
    scale placed, read over every answer at most the band's top (the search's readings are exact
    here); with no reading under the top the update is rejected (the step's start kept, scale 1),
    never the reference; the search spends at most ``max_forwards`` readings, plus the full one."""

    def kl(s):
        return scale * s ** power * (1 + wiggle * math.sin(7 * s))

    plant = Plant(kl)
    move = plant.hold(_ctl(max_forwards=forwards))
    assert plant.reads == move.forwards <= forwards + 1
    assert move.scale > 0
    if move.rejected:
        assert plant.rejected and move.scale == 1.0 and move.kl_kept == 0.5
    else:
        assert plant.scale == move.scale and move.kl_kept == kl(move.scale)
        if plant.moves:
            assert move.kl_kept <= 2.5


def test_no_scale_under_the_top_rejects_the_update():
    """A KL over the top at every scale tried: the update is rejected, the weights the step started
    from are kept (read once more over every answer, 0.5), the scale is 1 on their line, never 0."""
    plant = Plant(lambda s: 100.0 if s > 0 else 0.0)
    move = plant.hold(_ctl(max_forwards=3))
    assert plant.rejected and move.rejected and move.scale == 1.0 and move.kl_kept == 0.5
    assert move.forwards == 4 and 0.0 not in plant.moves
    assert move.metrics()["step_rejected"] is True


def test_a_ceiling_pulls_the_kept_weights_under_it():
    """KL = s^2, target 2 without push: 1.0 is in the band, kept; a ceiling of 0.5 then captures the
    weights and aims at min(2, 0.9 x 0.5) = 0.45 with KL ~ s^2: s = (0.45 / 1)^(1/2) = 0.67082,
    more than half, so taken: KL 0.45, one more reading over every answer."""
    plant = Plant(lambda s: s * s)
    move = plant.hold(_ctl(push=False), ceiling=0.5)
    assert move.scale == pytest.approx(math.sqrt(0.45), rel=1e-12)
    assert move.kl_kept == pytest.approx(0.45, rel=1e-12) and (move.forwards, plant.captures) == (2, 1)


def test_a_rejected_start_over_the_ceiling_is_pulled_under_it():
    """Every scale reads 100 (top 2.5), so the update is rejected; the start reads 5 > ceiling 4. The
    search's refit exponent hit its floor 0.5 (equal readings), so the pull's model asks for
    (2 / 5)^(1 / 0.5) = 0.16 of the start's line; no try goes below half, so 0.5: KL 5 x 0.5^2 =
    1.25 on the plant's s^2 line, under 4, one reading."""
    plant = Plant(lambda s: 100.0, start_kl=5.0)
    move = plant.hold(_ctl(max_forwards=2), ceiling=4.0)
    assert move.rejected and move.scale == 0.5 and move.kl_kept == 1.25
    assert plant.moves[-1] == move.scale and move.forwards == 4


def test_a_pull_lands_at_its_aim_not_at_a_quarter():
    """KL = 2.2 s^2 over a ceiling of 2 with no aim of its own: the goal is 0.9 x 2 = 1.8, reached in
    one try at s = (1.8 / 2.2)^(1/2) = 0.90453 (before, every try at least halved the scale: KL 0.55)."""
    plant = Plant(lambda s: 2.2 * s * s)
    scale, kl, spent = pull_under_ceiling(plant, plant.measure, 2.2, ceiling=2.0)
    assert scale == pytest.approx(math.sqrt(1.8 / 2.2), rel=1e-12) and kl == pytest.approx(1.8, rel=1e-12)
    assert spent == 1 and plant.captures == 1


def test_a_pull_refits_the_power_after_each_reading():
    """KL = s (linear, where the first model says s^2), ceiling 0.5, goal 0.45: the first try at
    s = 0.45^(1/2) = 0.67082 reads 0.67082, over; the refit exponent is log(0.67082) / log(0.67082)
    = 1, so the second try takes 0.45 / 0.67082 of it: s = 0.45, KL 0.45. (Kept at power 2 the
    tries would close in on 0.45 from above as sqrt(0.45 KL) and spend all eight readings.)"""
    plant = Plant(lambda s: s)
    scale, kl, spent = pull_under_ceiling(plant, plant.measure, 1.0, ceiling=0.5)
    assert plant.moves == pytest.approx([math.sqrt(0.45), 0.45], rel=1e-12)
    assert (scale, kl, spent) == pytest.approx((0.45, 0.45, 2), rel=1e-12)


def test_each_pull_try_at_most_halves_the_scale():
    """KL = 100 s^2, ceiling 4, aim 1: the model asks for s = 0.1, but a try takes at most half:
    0.5 (KL 25), then (1 / 25)^(1/2) = 0.2 -> half again, 0.25 (KL 6.25), then 0.4 -> half, 0.125
    (KL 1.5625 <= 4): three readings."""
    plant = Plant(lambda s: 100.0 * s * s)
    scale, kl, spent = pull_under_ceiling(plant, plant.measure, 100.0, ceiling=4.0, aim=1.0)
    assert plant.moves == [0.5, 0.25, 0.125] and (scale, kl, spent) == (0.125, 1.5625, 3)


@pytest.mark.parametrize("where", ["first", "search"])
def test_a_non_finite_reading_raises_naming_it(where):
    """NaN at the updated weights raises before any move; NaN during the search raises naming the scale."""
    plant = Plant((lambda s: math.nan) if where == "first" else (lambda s: 8.0 if s == 1.0 else math.nan))
    with pytest.raises(ValueError, match="the reading of (the updated weights|scale 0.5) is nan"):
        plant.hold(_ctl())
    assert plant.moves == ([] if where == "first" else [0.5])


def test_pull_under_ceiling_refuses_a_kl_that_does_not_shrink():
    plant = Plant(lambda s: 9.0)
    with pytest.raises(ValueError, match="did not fall under the ceiling 4"):
        pull_under_ceiling(plant, plant.measure, 9.0, ceiling=4.0, aim=2.0)


def test_beta_is_a_pi_rule_on_the_log_error():
    """e = log(KL / target) clipped to [-1, 1]; I += 0.25 e; beta = exp(I + 0.5 e).
    From beta 0.1: KL 4 at target 2 gives e = log 2, I = log 0.1 + 0.25 log 2,
    beta = 0.1 * 2^0.75 = 0.168179; then KL 2 gives e = 0 and beta = 0.1 * 2^0.25 = 0.118921;
    then KL 0 gives e = -1: I = log 0.1 + 0.25 log 2 - 0.25, beta = 0.118921 * exp(-0.75)."""
    ctl = _ctl()
    assert ctl.update([4.0, 4.0]) == pytest.approx(0.1 * 2 ** 0.75, rel=1e-12)
    assert ctl.update(2.0, n_steps=3) == pytest.approx(0.1 * 2 ** 0.25, rel=1e-12)
    assert ctl.update([0.0]) == pytest.approx(0.1 * 2 ** 0.25 * math.exp(-0.75), rel=1e-12)


def test_beta_stays_in_its_bounds_without_wind_up():
    """Twenty readings far over target drive beta to max_coef; the integral stops there too, so one
    reading at target brings beta straight back under the bound."""
    ctl = _ctl(max_coef=1.0)
    for _ in range(20):
        ctl.update([1e6])
    assert ctl.kl_coef == 1.0 and ctl.integral == 0.0
    assert ctl.update([2.0]) == 1.0  # e = 0: exp(I) = exp(0)


def test_hold_steps_beta_from_the_kl_before_the_move():
    """The updated weights read 8 at target 2: e = log 4 = 1.39, clipped to 1; beta = 0.1 e^0.75."""
    plant = Plant(lambda s: 8.0 * s * s)
    ctl = _ctl()
    plant.hold(ctl)
    assert ctl.kl_coef == pytest.approx(0.1 * math.exp(0.75), rel=1e-12)


def test_state_round_trip_and_registry():
    ctl = make_kl_controller("budget", init_kl_coef=0.3, target=1.5)
    assert isinstance(ctl, BudgetKLController)
    plant = Plant(lambda s: 9.0 * s ** 3)
    plant.hold(ctl)
    other = make_kl_controller("budget", init_kl_coef=0.2, target=9.0)
    other.load_state_dict(ctl.state_dict())
    assert other.state_dict() == ctl.state_dict()
    with pytest.raises(KeyError, match=r"BudgetKLController.load_state_dict expected keys .* missing \['power'\]"):
        other.load_state_dict({k: v for k, v in ctl.state_dict().items() if k != "power"})


class Leashed:
    kl_coef = 0.0


def test_drives_kl_coef_of_its_model():
    target = Leashed()
    ctl = _ctl(model=target)
    assert target.kl_coef == 0.1
    ctl.update([20.0])
    assert target.kl_coef == ctl.kl_coef


@pytest.mark.parametrize("kw, error, text", [
    ({"band": 1.0}, ValueError, "band: expected a finite number in (0, 1), got 1.0"),
    ({"max_scale": 0.5}, ValueError, "max_scale: expected a finite number >= 1, got 0.5. push=False never pushes."),
    ({"push": "no"}, TypeError, "push: expected True or False, got 'no'"),
    ({"max_forwards": 1}, ValueError, "max_forwards: expected an int >= 2, got 1. One measures the updated weights"),
    ({"target": 0}, ValueError, "target: expected a finite number > 0, got 0"),
    ({"init_kl_coef": 1e-6}, ValueError, "init_kl_coef: expected a finite number in [0.0001, 1000], got 1e-06"),
    ({"max_forwards": 2.5}, TypeError, "max_forwards: expected an int"),
])
def test_bad_arguments_name_themselves(kw, error, text):
    with pytest.raises(error) as info:
        _ctl(**kw)
    assert text in str(info.value)
