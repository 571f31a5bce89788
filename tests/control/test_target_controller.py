"""TargetKLController: the update by hand, a simulated plant, bounds under any input, state."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.control import TargetKLController, make_kl_controller

BETA_STAR = 0.2  # the beta at which the simulated policy settles exactly at the target
TARGET = 2.0


class LaggedPlant:
    """A policy's KL as a function of beta: equilibrium ``TARGET * (BETA_STAR / beta)^a``,
    approached by the fraction ``lag`` of the gap per step, at most ``rate * TARGET`` up per
    step (the learning rate bounds how fast a policy can drift), measured with relative
    Gaussian noise. The KL measured at a step reflects the beta of the step before."""

    def __init__(self, *, a: float, lag: float, noise: float = 0.05, rate: float = 0.5, seed: int = 0):
        self.a, self.lag, self.noise, self.rate = a, lag, noise, rate
        self.kl, self.rng = 0.0, random.Random(seed)

    def measure(self) -> float:
        return self.kl * (1.0 + self.noise * self.rng.gauss(0.0, 1.0))

    def respond(self, beta: float) -> None:
        settled = TARGET * (BETA_STAR / beta) ** self.a
        self.kl += min(self.lag * (settled - self.kl), self.rate * TARGET)


def in_band(kls: list[float]) -> float:
    """Share of ``kls`` within +-25 % of the target."""
    return sum(abs(kl / TARGET - 1) <= 0.25 for kl in kls) / len(kls)


def drive(controller, plant, steps: int) -> list[float]:
    """The order of ``tether train``: measure the batch's KL, update beta, train with it."""
    measured = []
    for _ in range(steps):
        kl = plant.measure()
        measured.append(kl)
        controller.update(kl, n_steps=64)
        plant.respond(controller.kl_coef)
    return measured


def test_update_by_hand():
    """beta 0.2, target 2 and the defaults brake_gain 1, release_gain 0.75, lookahead 3,
    smoothing 0.5, max_rise 1, max_fall 1; forecast p = KL + 3 * trend,
    e = clip(log(p / 2), -1, 1), held at 0 if e < 0 but KL + 6 * trend >= 2:

    1. KL 0: first update, beta kept: 0.2.
    2. KL 1: change 1 is the trend; p = 1 + 3 = 4, e = log 2: the KL is still under
       target but rising fast, so beta rises already: 0.2 * 2 = 0.4.
    3. KL 2: change 1, trend 1 + 0.5 * (1 - 1) = 1; p = 5, e = log 2.5: 0.4 * 2.5 = 1.
    4. KL 0: change -2, trend 1 + 0.5 * (-2 - 1) = -0.5; p = -1.5 <= 0, e = -1 (not held:
       0 - 6 * 0.5 < 2): beta *= e^-0.75, 0.472367.
    5. KL 50: change 50, trend -0.5 + 0.5 * 50.5 = 24.75; p = 124.25, log 62.125 clipped
       to 1: beta *= e, e^0.25 = 1.284025.
    """
    ctl = TargetKLController(init_kl_coef=0.2, target=2.0)
    got = [ctl.update(torch.tensor([kl, kl], dtype=torch.float64)) for kl in (0.0, 1.0, 2.0, 0.0, 50.0)]
    assert got == pytest.approx([0.2, 0.4, 1.0, math.exp(-0.75), math.exp(0.25)], rel=1e-12)
    assert [round(v, 6) for v in got[1:]] == [0.4, 1.0, 0.472367, 1.284025]
    assert ctl.trend == 24.75 and ctl.last_kl == 50.0


def test_no_release_while_the_kl_is_on_its_way():
    """KLs 0, 0.3, 0.6, 0.6 with target 2 (defaults as above):

    2. trend 0.3, p = 0.3 + 0.9 = 1.2 under target, but 0.3 + 6 * 0.3 = 2.1 >= 2: held, 0.2.
    3. trend 0.3, p = 1.5 under target, 0.6 + 1.8 = 2.4 >= 2: held, 0.2.
    4. change 0, trend 0.15; p = 1.05, and 0.6 + 0.9 = 1.5 < 2: the climb has stalled, so
       beta is released: e = log 0.525, beta = 0.2 * 0.525^0.75 = 0.123353.
    """
    ctl = TargetKLController(init_kl_coef=0.2, target=2.0)
    got = [ctl.update(kl, n_steps=4) for kl in (0.0, 0.3, 0.6, 0.6)]
    assert got == pytest.approx([0.2, 0.2, 0.2, 0.2 * 0.525 ** 0.75], rel=1e-12)
    assert round(got[-1], 6) == 0.123353


def test_no_release_while_the_kl_still_grows_by_a_quarter_a_step():
    """KLs 0, 0.1, 0.3, 0.32 with target 2 (defaults): the climb from 0 accelerates, so the
    linear forecasts stay under target, but the KL grows x1.25 or more a step:

    2. trend 0.1, p = 0.4 (e = -1), 0.1 + 0.6 < 2, but 0.1 >= 1.25 * 0: held, 0.2.
    3. trend 0.1 + 0.5 * 0.1 = 0.15, p = 0.75, 0.3 + 0.9 < 2, but 0.3 >= 0.125: held, 0.2.
    4. 0.32 < 1.25 * 0.3 and 0.32 + 6 * 0.085 < 2: released, p = 0.575, log 0.2875
       clipped to -1: 0.2 e^-0.75.
    With ``hold_growth=inf`` the release starts at update 2. A KL at 0 is never held."""
    kls = (0.0, 0.1, 0.3, 0.32)
    held = TargetKLController(init_kl_coef=0.2, target=2.0)
    assert [held.update(kl, n_steps=4) for kl in kls] == pytest.approx([0.2, 0.2, 0.2, 0.2 * math.exp(-0.75)], rel=1e-12)
    free = TargetKLController(init_kl_coef=0.2, target=2.0, hold_growth=math.inf)
    assert free.update(0.0, n_steps=4) == 0.2 and free.update(0.1, n_steps=4) == pytest.approx(0.2 * math.exp(-0.75))
    zeros = TargetKLController(init_kl_coef=0.2, target=2.0)
    assert [zeros.update(0.0, n_steps=4) for _ in range(3)] == pytest.approx([0.2 * math.exp(-0.75 * k) for k in range(3)])


class AccumulatingPlant:
    """The KL of a language model under RL: each update adds a drift ``D`` (with 30 %
    noise) and takes back the share ``c * beta`` of the KL, ``m += D - c * beta * m``, the
    drift decaying over ``decay`` steps as the task is learnt; measured with 10 % relative
    noise. At the right beta ``BETA_STAR`` the KL settles at ``TARGET`` with time constant
    ``tau`` steps, so ``D = TARGET / tau`` and ``c = 1 / (tau * BETA_STAR)``."""

    def __init__(self, *, tau: float, decay: float, seed: int):
        self.drift, self.leak, self.decay = TARGET / tau, 1.0 / (tau * BETA_STAR), decay
        self.kl, self.steps, self.rng = 0.0, 0, random.Random(seed)

    def measure(self) -> float:
        return max(0.0, self.kl * (1.0 + 0.1 * self.rng.gauss(0.0, 1.0)))

    def respond(self, beta: float) -> None:
        drift = self.drift * math.exp(-self.steps / self.decay) * (1.0 + 0.3 * self.rng.gauss(0.0, 1.0))
        self.kl = max(0.0, self.kl + drift - min(self.leak * beta, 0.9) * self.kl)
        self.steps += 1


@pytest.mark.parametrize("start", [BETA_STAR / 7.5, BETA_STAR, BETA_STAR * 5])
@pytest.mark.parametrize("tau", [3.0, 4.0, 6.0])
@pytest.mark.parametrize("decay", [math.inf, 30.0])
def test_holds_the_target_on_an_accumulating_plant(start, tau, decay):
    """The plant the defaults were chosen on (module docstring), from starts x7.5 too weak
    to x5 too strong: over 5 seeds of 40 steps, on average >= 70 % of the KLs after the
    first quarter lie within +-25 % of the target (70-94 % across these cases; the drift
    noise alone puts some steps outside), and every run's last 10 average within 10 %."""
    runs = [drive(TargetKLController(init_kl_coef=start, target=TARGET),
                  AccumulatingPlant(tau=tau, decay=decay, seed=seed), 40) for seed in range(5)]
    inside = [in_band(run[10:]) for run in runs]
    assert sum(inside) / len(inside) >= 0.7, inside
    for run in runs:
        assert sum(run[-10:]) / 10 == pytest.approx(TARGET, rel=0.1)


@pytest.mark.parametrize("start", [BETA_STAR / 7.5, BETA_STAR])
def test_a_level_only_controller_overshoots_the_accumulating_plant(start):
    """Why the forecast: in 16-step runs (time constant 6), the same rule acting on the
    level alone (lookahead 0 and hold_growth inf: no forecast, never holds) brakes only once the KL is over
    target and overshoots to 3.7-3.9 nats; the forecasting default peaks under 3 on average
    and has at least twice the share of post-warm-up steps in the band."""
    def runs(lookahead: float) -> list[list[float]]:
        hold = math.inf if lookahead == 0 else 1.25
        return [drive(TargetKLController(init_kl_coef=start, target=TARGET, lookahead=lookahead, hold_growth=hold),
                      AccumulatingPlant(tau=6.0, decay=math.inf, seed=seed), 16) for seed in range(8)]

    def peak(measured: list[list[float]]) -> float:
        return sum(max(run) for run in measured) / len(measured)

    def mean_in_band(measured: list[list[float]]) -> float:
        return sum(in_band(run[4:]) for run in measured) / len(measured)

    level, forecast = runs(0.0), runs(3.0)
    assert peak(level) > 3.5 > 3.0 > peak(forecast)
    assert mean_in_band(forecast) >= 2 * mean_in_band(level)


@pytest.mark.parametrize("start", [BETA_STAR / 6, BETA_STAR, BETA_STAR * 5])
@pytest.mark.parametrize("a", [1.0, 2.0])
@pytest.mark.parametrize("lag", [0.3, 0.5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reaches_and_holds_the_target_on_a_lagged_plant(start, a, lag, seed):
    """The other plant shape, a KL that settles at an equilibrium set by beta: from starts
    spanning x30 around the right beta, on plants with slope 1 and 2 that close 30 % or
    50 % of the gap per step, after the first quarter of 40 steps at least 75 % of the
    KLs lie within +-25 % of the target (77 % in the worst case, slope 2 from a start x5 too
    strong: the first release overshoots once) and the last 10 average within 10 % of it.
    (A plant that closes the whole gap in one step with slope 2 makes the forecast
    oscillate: 40-60 % in band. The language model is not that plant: its KL lags beta by
    several steps.)"""
    measured = drive(TargetKLController(init_kl_coef=start, target=TARGET), LaggedPlant(a=a, lag=lag, seed=seed), 40)
    inside = in_band(measured[10:])
    assert inside >= 0.75, [round(k, 2) for k in measured]
    assert sum(measured[-10:]) / 10 == pytest.approx(TARGET, rel=0.1)


def test_ziegler_controller_misses_the_band_on_the_same_plant():
    """The reason for the new controller: the adaptive rule (horizon 2000 sequences, 64 a
    step) moves beta by at most 0.64 % a step, so a start x5 too weak stays far above target."""
    ctl = make_kl_controller("adaptive", init_kl_coef=BETA_STAR / 5, target=TARGET, horizon=2000)
    measured = drive(ctl, LaggedPlant(a=1.0, lag=0.5), 40)
    assert in_band(measured[10:]) == 0


@settings(max_examples=200, deadline=None)
@given(
    kls=st.lists(st.one_of(st.floats(-50, 1e30), st.sampled_from([0.0, 5e-324, 1e300, -1e300])), min_size=1, max_size=30),
    start=st.floats(1e-4, 1e3),
)
def test_beta_stays_positive_finite_bounded_and_moves_by_bounded_factors(kls, start):
    """Whatever finite KLs come (0, negative k1 means, 1e300), beta stays in [min, max] and
    each update multiplies it by a factor in [e^-0.75, e^1] (or stops at a bound)."""
    ctl = TargetKLController(init_kl_coef=start, target=TARGET)
    for kl in kls:
        before = ctl.kl_coef
        beta = ctl.update(kl, n_steps=8)
        assert isinstance(beta, float) and math.isfinite(beta)
        assert ctl.min_coef <= beta <= ctl.max_coef
        at_bound = beta in (ctl.min_coef, ctl.max_coef)
        assert at_bound or math.exp(-0.75) * (1 - 1e-12) <= beta / before <= math.e * (1 + 1e-12)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_kl_is_an_error_not_a_beta(bad):
    ctl = TargetKLController(init_kl_coef=0.2, target=TARGET)
    ctl.update(1.0, n_steps=4)
    with pytest.raises(ValueError, match="kl_values must be finite"):
        ctl.update([1.0, bad])
    assert ctl.kl_coef == 0.2 and ctl.last_kl == 1.0


def test_state_round_trips_through_json_and_resumes_bit_exactly():
    kls = [0.0, 0.7, 1.9, 2.6, 2.2, 1.4, 2.05, 2.3]
    straight = TargetKLController(init_kl_coef=0.05, target=TARGET, brake_gain=0.3, lookahead=0.5)
    for kl in kls[:4]:
        straight.update(kl, n_steps=3)
    state = json.loads(json.dumps(straight.state_dict()))
    resumed = TargetKLController(init_kl_coef=1.0, target=9.0)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == straight.state_dict()
    assert [resumed.update(kl, n_steps=3) for kl in kls[4:]] == [straight.update(kl, n_steps=3) for kl in kls[4:]]


def test_drives_every_given_component():
    class Knob:
        kl_coef = -1.0

    knobs = [Knob(), Knob()]
    ctl = TargetKLController(init_kl_coef=0.3, target=TARGET, model=knobs)
    assert [k.kl_coef for k in knobs] == [0.3, 0.3]
    ctl.update(0.0, n_steps=2)
    beta = ctl.update(0.0, n_steps=2)
    assert beta < 0.3 and [k.kl_coef for k in knobs] == [beta, beta]


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(target=0.0), ValueError, "target: expected a finite number > 0"),
        (dict(brake_gain=-1.0), ValueError, "brake_gain: expected a finite number > 0"),
        (dict(release_gain=0.0), ValueError, "release_gain: expected a finite number > 0"),
        (dict(lookahead=-0.5), ValueError, "lookahead: expected a finite number >= 0"),
        (dict(smoothing=0.0), ValueError, r"smoothing: expected a finite number in \(0, 1\], got 0.0"),
        (dict(hold_growth=1.0), ValueError, "hold_growth: expected a number > 1"),
        (dict(smoothing=1.5), ValueError, r"smoothing: expected a finite number in \(0, 1\], got 1.5"),
        (dict(min_coef=0.0), ValueError, "min_coef: expected a finite number > 0"),
        (dict(max_coef=1e-5), ValueError, "max_coef: expected a finite number >= 0.0001"),
        (dict(max_coef=math.inf), ValueError, "max_coef: expected a finite number >= 0.0001, got inf"),
        (dict(init_kl_coef=5e3), ValueError, r"init_kl_coef: expected a finite number in \[0.0001, 1000\], got 5000.0"),
        (dict(target="2"), TypeError, "target: expected a finite number > 0, got '2' of type str"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        TargetKLController(**{"init_kl_coef": 0.2, "target": TARGET, **kwargs})


def test_bad_state_is_refused():
    ctl = TargetKLController(init_kl_coef=0.2, target=TARGET)
    state = ctl.state_dict()
    with pytest.raises(KeyError, match="missing \\['num_updates'\\]"):
        ctl.load_state_dict({k: v for k, v in state.items() if k != "num_updates"})
    with pytest.raises(ValueError, match="num_updates: expected an int >= 0"):
        ctl.load_state_dict({**state, "num_updates": -1})
    with pytest.raises(ValueError, match="last_kl: expected a finite number"):
        ctl.load_state_dict({**state, "last_kl": math.nan})
    with pytest.raises(TypeError, match="trend: expected a finite number, got .* of type"):
        ctl.load_state_dict({**state, "trend": None})
