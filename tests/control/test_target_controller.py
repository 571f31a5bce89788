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


def drive(controller, plant: LaggedPlant, steps: int) -> list[float]:
    measured = []
    for _ in range(steps):
        kl = plant.measure()
        measured.append(kl)
        plant.respond(controller.kl_coef)
        controller.update(kl, n_steps=64)
    return measured


def test_update_by_hand():
    """beta 0.2, target 2, gain 0.25, lookahead 1, max_rise 2, max_fall 3 (the defaults);
    l(kl) = clip(log(kl / 2), -3, 2), e = clip(l_t + (l_t - l_{t-1}), -3, 2):

    1. KL 0: first update, beta kept: 0.2.
    2. KL 1: l = log 0.5 = -0.693147, previous l(0) = -3, e = -0.693147 + 2.306853 =
       1.613706: the KL rose half-way to the target in one step, so beta rises already:
       0.2 * exp(0.25 * 1.613706) = 0.299389.
    3. KL 2: l = 0, e = 0 + 0.693147 = log 2, beta *= 2^0.25: 0.356036.
    4. KL 0: l = -3, e = -3 - 3 = -6 clipped to -3, beta *= e^-0.75: 0.168179.
    5. KL 50: l = log 25 clipped to 2, e = 2 + 5 clipped to 2, beta *= e^0.5: 0.277281.
    """
    ctl = TargetKLController(init_kl_coef=0.2, target=2.0)
    got = [ctl.update(torch.tensor([kl, kl], dtype=torch.float64)) for kl in (0.0, 1.0, 2.0, 0.0, 50.0)]
    b2 = 0.2 * math.exp(0.25 * (2 * math.log(0.5) + 3))
    b3 = b2 * 2 ** 0.25
    b4 = b3 * math.exp(-0.75)
    b5 = b4 * math.exp(0.5)
    assert got == pytest.approx([0.2, b2, b3, b4, b5], rel=1e-12)
    assert [round(v, 6) for v in got[1:]] == [0.299389, 0.356036, 0.168179, 0.277281]


@pytest.mark.parametrize("start", [BETA_STAR / 6, BETA_STAR, BETA_STAR * 5])
@pytest.mark.parametrize("a", [1.0, 2.0])
@pytest.mark.parametrize("lag", [0.3, 0.5, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reaches_and_holds_the_target_on_a_lagged_plant(start, a, lag, seed):
    """From starts spanning x30 around the right beta, on plants with slope 1 and 2 that
    close 30 %, 50 % or all of the gap to their equilibrium per step: after the first quarter of 40 steps, at least 80 % of the measured
    KLs lie within +-25 % of the target and the last 10 average within 10 % of it."""
    measured = drive(TargetKLController(init_kl_coef=start, target=TARGET), LaggedPlant(a=a, lag=lag, seed=seed), 40)
    after = measured[10:]
    inside = sum(abs(kl / TARGET - 1) <= 0.25 for kl in after) / len(after)
    assert inside >= 0.8, [round(k, 2) for k in measured]
    assert sum(measured[-10:]) / 10 == pytest.approx(TARGET, rel=0.1)


def test_ziegler_controller_misses_the_band_on_the_same_plant():
    """The reason for the new controller: the adaptive rule (horizon 2000 sequences, 64 a
    step) moves beta by at most 0.64 % a step, so a start x5 too weak stays far above target."""
    ctl = make_kl_controller("adaptive", init_kl_coef=BETA_STAR / 5, target=TARGET, horizon=2000)
    measured = drive(ctl, LaggedPlant(a=1.0, lag=0.5), 40)
    assert sum(abs(kl / TARGET - 1) <= 0.25 for kl in measured[10:]) == 0


@settings(max_examples=200, deadline=None)
@given(
    kls=st.lists(st.one_of(st.floats(-50, 1e30), st.sampled_from([0.0, 5e-324, 1e300, -1e300])), min_size=1, max_size=30),
    start=st.floats(1e-4, 1e3),
)
def test_beta_stays_positive_finite_bounded_and_moves_by_bounded_factors(kls, start):
    """Whatever finite KLs come (0, negative k1 means, 1e300), beta stays in [min, max] and
    each update multiplies it by a factor in [e^-0.75, e^0.5] (or stops at a bound)."""
    ctl = TargetKLController(init_kl_coef=start, target=TARGET)
    for kl in kls:
        before = ctl.kl_coef
        beta = ctl.update(kl, n_steps=8)
        assert isinstance(beta, float) and math.isfinite(beta)
        assert ctl.min_coef <= beta <= ctl.max_coef
        at_bound = beta in (ctl.min_coef, ctl.max_coef)
        assert at_bound or math.exp(-0.75) * (1 - 1e-12) <= beta / before <= math.exp(0.5) * (1 + 1e-12)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_kl_is_an_error_not_a_beta(bad):
    ctl = TargetKLController(init_kl_coef=0.2, target=TARGET)
    ctl.update(1.0, n_steps=4)
    with pytest.raises(ValueError, match="kl_values must be finite"):
        ctl.update([1.0, bad])
    assert ctl.kl_coef == 0.2 and ctl.last_kl == 1.0


def test_state_round_trips_through_json_and_resumes_bit_exactly():
    kls = [0.0, 0.7, 1.9, 2.6, 2.2, 1.4, 2.05, 2.3]
    straight = TargetKLController(init_kl_coef=0.05, target=TARGET, gain=0.3, lookahead=0.5)
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
        (dict(target=0.0), ValueError, "target must be > 0.0"),
        (dict(gain=-1.0), ValueError, "gain must be > 0.0"),
        (dict(lookahead=-0.5), ValueError, "lookahead must be >= 0.0"),
        (dict(min_coef=0.0), ValueError, "min_coef must be > 0.0"),
        (dict(max_coef=1e-5), ValueError, "max_coef must be >= 0.0001"),
        (dict(max_coef=math.inf), ValueError, "max_coef must be finite"),
        (dict(init_kl_coef=5e3), ValueError, r"init_kl_coef must lie in \[min_coef, max_coef\]"),
        (dict(target="2"), TypeError, "target must be a real number"),
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
    with pytest.raises(ValueError, match="num_updates must be an int >= 0"):
        ctl.load_state_dict({**state, "num_updates": -1})
    with pytest.raises(ValueError, match="last_kl must be finite"):
        ctl.load_state_dict({**state, "last_kl": math.nan})
