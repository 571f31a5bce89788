"""``TargetKLController``: holds the measured KL per answer at a target by moving log beta.

The Ziegler et al. controller (``AdaptiveKLController``) caps its correction at
``0.2 * n_steps / horizon`` per update, so a run of a few dozen steps ends before beta has
moved far, and while the KL is still under target at the start it lowers beta, which makes
the later overshoot worse. This controller is built for short, fast-moving runs instead:

Update, once per step, from the mean per-sequence KL ``m_t`` (nats per answer)::

    l_t        = clip(log(m_t / target), -max_fall, max_rise)   # -max_fall for m_t <= 0
    e_t        = clip(l_t + lookahead * (l_t - l_{t-1}), -max_fall, max_rise)
    log beta  += gain * e_t
    beta       = clip(beta, min_coef, max_coef)

``e_t`` is a proportional-derivative error in log space: where the log KL will be one
(``lookahead``) step ahead if its trend holds.

Why it is stable: near its equilibrium the KL a policy settles at falls like a power of
beta, ``KL ~ c * beta^(-a)`` (``a`` about 2 when the leash is strong: ``KL ~ Var(r) /
(2 beta^2)``; about 1 or less when it is weak). In log-log coordinates the plant is then a
straight line of slope ``-a`` and the update is an integral controller on it. The KL
measured at step ``t`` reflects the beta of step ``t - 1`` (one step of delay), so with
``x = log beta`` the loop is ``x_{t+1} = x_t - gain * a * ((1 + h) x_{t-1} - h x_{t-2})``
(``h`` the lookahead): its roots lie inside the unit circle for ``gain * a < 1`` when
``h = 0`` and for ``gain * a`` up to about 0.6 when ``h = 1`` (spectral radius 0.77 at
0.25, 0.88 at 0.5). The default ``gain = 0.25`` therefore tolerates ``a`` up to about 2.4.
A policy does not reach its equilibrium in one step: the KL follows beta with a lag of a
few optimiser steps, and an integral controller alone keeps lowering beta while the KL
is still climbing towards the target, then overshoots. The lookahead term (a derivative
action) answers a rising KL before it crosses the target and a falling one before it
undershoots; it costs stability margin on a plant without lag, hence ``h = 1``, not more.
Working on log beta makes every correction a multiplication: beta can never reach 0,
turn negative or become NaN, and one rule fits any scale of beta (the benchmark varies
the start over a x30 range). The constants were chosen on a simulated plant (closing 30-100 %
of the gap to equilibrium per step, ``a`` of 1 and 2, starts x5 above and x6 below the
right beta, 5 % measurement noise), the one the tests use, not on the language model.
Taking the trend of the log KL rather than of the KL matters: a KL falling from 4.5 to
2.3 nats (target 2) extrapolates linearly to 0 and would halve beta, geometrically to
1.2 nats and lowers it by 10 %.

Bounds: beta stays in ``[min_coef, max_coef]`` (defaults ``1e-4`` and ``1e3``, part of the
configuration; a clipped beta does not accumulate hidden "wind-up", because the state
is beta itself). One update multiplies beta by a factor in
``[exp(-gain * max_fall), exp(gain * max_rise)]``, about ``[0.47, 1.65]`` by default:
releasing a leash that holds the KL near 0 is safe and fast, while a harder brake than
x1.65 swings through the one-step delay into an undershoot (seen on the simulated plant).

Special cases:

* First update: beta is kept and the measurement only recorded. At the first step of a
  run the policy is the reference, so the KL is 0 by construction and says nothing about
  beta; and no trend can be formed from one measurement.
* KL 0 (or a negative sampled k1 mean, whose true KL is >= 0): the log error saturates
  at ``-max_fall``, and beta falls by the largest factor per step
  (a x30 too strong start is undone in about 5 updates).
* A KL jump (collapse onto a degenerate answer, a bad batch): the lookahead doubles the
  jump in log space, the error saturates at ``+max_rise``, and beta grows by the largest factor
  (x1.65) at once and on every following step the KL stays above target. When the
  KL comes back down the negative trend lowers beta again, so a single noisy batch
  costs one raise and one fall, not a lasting shift.

The controller is measurement-agnostic; ``tether train`` feeds it the exact
full-vocabulary KL per answer (see ``tether.train.kl_signal``), which has no sampling
noise from the token draw at each position, so the derivative term amplifies less noise.
"""

from __future__ import annotations

import math
from typing import Any

from tether.control._checks import (
    check_state_keys,
    control_targets,
    mean_sequence_kl,
    push_coef,
    real_number,
)

__all__ = ["TargetKLController"]


class TargetKLController:
    """Sets beta every step so that the mean per-sequence KL stays at ``target``.

    Args:
        init_kl_coef: starting beta, inside ``[min_coef, max_coef]`` (> 0: the update
            multiplies it).
        target: KL to hold, in nats per sequence (> 0): mean over sequences of the KL
            summed over each sequence's response tokens.
        model: optional object, or list/tuple of objects, with a read/write ``kl_coef``;
            each receives beta at construction and after every update.
        gain: step size on ``log beta`` per unit of log error (> 0).
        lookahead: how many steps ahead the KL trend is extrapolated (>= 0; 0 turns the
            derivative action off).
        max_rise, max_fall: clip of the log error above and below 0 (> 0).
        min_coef, max_coef: bounds on beta, ``0 < min_coef <= max_coef < inf``.

    The update rule, its stability argument and the special cases are in the module
    docstring. ``update`` takes the same inputs as ``AdaptiveKLController.update``.
    """

    _CONFIG = ("target", "gain", "lookahead", "max_rise", "max_fall", "min_coef", "max_coef")
    _STATE_KEYS = ("kl_coef", *_CONFIG, "last_kl", "num_updates")

    def __init__(
        self,
        *,
        init_kl_coef: float,
        target: float,
        model: Any = None,
        gain: float = 0.25,
        lookahead: float = 1.0,
        max_rise: float = 2.0,
        max_fall: float = 3.0,
        min_coef: float = 1e-4,
        max_coef: float = 1e3,
    ) -> None:
        config = dict(target=target, gain=gain, lookahead=lookahead, max_rise=max_rise,
                      max_fall=max_fall, min_coef=min_coef, max_coef=max_coef)
        self._configure(config, init_kl_coef, "init_kl_coef")
        self.last_kl: float | None = None
        self.num_updates = 0
        self.models = control_targets(model)
        push_coef(self.models, self._coef)

    def _configure(self, config: dict[str, Any], coef: Any, coef_name: str) -> None:
        for name in ("target", "gain", "max_rise", "max_fall", "min_coef"):
            setattr(self, name, real_number(name, config[name], minimum=0.0, strict=True))
        self.lookahead = real_number("lookahead", config["lookahead"], minimum=0.0)
        self.max_coef = real_number("max_coef", config["max_coef"], minimum=self.min_coef)
        coef = real_number(coef_name, coef)
        if not self.min_coef <= coef <= self.max_coef:
            raise ValueError(
                f"{coef_name} must lie in [min_coef, max_coef] = [{self.min_coef}, "
                f"{self.max_coef}]; got {coef}. Start inside the bounds or widen them."
            )
        self._coef = coef

    @property
    def kl_coef(self) -> float:
        return self._coef

    coef = kl_coef  # the seed's attribute name, as on the other controllers

    def log_ratio(self, kl: float | None) -> float:
        """``log(kl / target)`` clipped to ``[-max_fall, max_rise]``; -max_fall for kl <= 0."""
        ratio = 0.0 if kl is None else kl / self.target
        if ratio <= 0:  # also a positive KL that underflows the division (5e-324 / 2)
            return -self.max_fall
        return min(max(math.log(ratio), -self.max_fall), self.max_rise)

    def update(self, kl_values: Any = None, n_steps: int | None = None) -> float:
        """Moves beta after one batch and returns it; the inputs are those of
        ``AdaptiveKLController.update`` (per-sequence KLs, or their mean with ``n_steps``)."""
        kl, _ = mean_sequence_kl(kl_values, n_steps)
        if self.num_updates > 0:
            now, before = self.log_ratio(kl), self.log_ratio(self.last_kl)
            error = min(max(now + self.lookahead * (now - before), -self.max_fall), self.max_rise)
            coef = self._coef * math.exp(self.gain * error)
            self._coef = min(max(coef, self.min_coef), self.max_coef)
        self.last_kl = kl
        self.num_updates += 1
        push_coef(self.models, self._coef)
        return self._coef

    def state_dict(self) -> dict[str, Any]:
        state = {name: getattr(self, name) for name in self._CONFIG}
        return {"kl_coef": self._coef, **state, "last_kl": self.last_kl,
                "num_updates": self.num_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, self._STATE_KEYS, type(self).__name__)
        last_kl, count = state["last_kl"], state["num_updates"]
        if last_kl is not None:
            last_kl = real_number("last_kl", last_kl)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"num_updates must be an int >= 0; got {count!r}. Pass a dict produced by "
                f"TargetKLController.state_dict()."
            )
        self._configure(state, state["kl_coef"], "kl_coef")
        self.last_kl, self.num_updates = last_kl, count
        push_coef(self.models, self._coef)

    def __repr__(self) -> str:
        config = ", ".join(f"{name}={getattr(self, name)}" for name in self._CONFIG)
        return f"{type(self).__name__}(kl_coef={self._coef}, {config})"
