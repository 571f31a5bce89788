"""``TargetKLController``: holds the measured KL per answer at a target by moving log beta.

Ziegler et al.'s controller (``AdaptiveKLController``) caps its correction at
``0.2 * n_steps / horizon`` a step and lowers beta while the KL is still under target, too slow
for short runs whose KL accumulates. This one, once per step, from the mean per-sequence KL:

* forecasts the KL ``lookahead`` steps ahead from a smoothed linear trend and moves
  ``log beta`` by ``gain * clip(log(forecast / target), -max_fall, max_rise)``, braking
  (``brake_gain``) faster than it releases (``release_gain``);
* does not release beta while the KL is on its way (its forecast twice as far ahead reaches
  the target, or it still grows by ``hold_growth`` a step);
* keeps beta at the first update (the policy is the reference, the KL is 0);
* keeps beta within ``[min_coef, max_coef]``; working on log beta, it never reaches 0,
  turns negative or becomes NaN.

The constants were chosen on a simulated accumulating plant, not tuned on a language model.
The update in full, why it forecasts, why it is stable, its special cases and the measurements
behind it are in the docs (``docs/leash.md``, "The target controller in detail").
"""

from __future__ import annotations

import math
from typing import Any

from tether.control.kl_io import (
    SequenceKL,
    check_state_keys,
    control_targets,
    one_knob,
    push_coef,
    torchrl_kl,
)
from tether.ops.checks import real_number, whole_number

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
        brake_gain: step size on ``log beta`` per unit of log error when the forecast is over
            target (> 0).
        release_gain: the same when it is under target (> 0).
        lookahead: how many steps ahead the KL trend is extrapolated (>= 0; 0 acts on the
            level alone).
        hold_growth: no release while the KL grows by this factor or more a step (> 1;
            ``inf`` turns that hold off).
        smoothing: weight of the newest change in the trend, in ``(0, 1]`` (1: no smoothing).
        max_rise, max_fall: clip of the log error above and below 0 (> 0).
        min_coef, max_coef: bounds on beta, ``0 < min_coef <= max_coef < inf``.

    The update rule, why it forecasts, its stability and the special cases are in the
    module docstring. ``update`` takes the same inputs as ``AdaptiveKLController.update``.

    Examples:
        >>> ctl = TargetKLController(init_kl_coef=0.1, target=3.0)
        >>> ctl.update([3.0, 3.0])  # the first update keeps beta (the policy starts at the reference)
        0.1
        >>> # KL 6, trend 0.5 * (6 - 3) = 1.5, forecast 6 + 3 * 1.5 = 10.5: log(10.5 / 3) = 1.25 is clipped to
        >>> # max_rise = 1, and brake_gain 1 multiplies beta by e
        >>> round(ctl.update([6.0]), 6)
        0.271828
    """

    _CONFIG = ("target", "brake_gain", "release_gain", "lookahead", "hold_growth", "smoothing", "max_rise",
               "max_fall", "min_coef", "max_coef")
    _STATE_KEYS = ("kl_coef", *_CONFIG, "last_kl", "trend", "num_updates")

    def __init__(
        self,
        *,
        init_kl_coef: float | None = None,
        target: float | None = None,
        model: Any = None,
        brake_gain: float = 1.0,
        release_gain: float = 0.75,
        lookahead: float = 3.0,
        hold_growth: float = 1.25,
        smoothing: float = 0.5,
        max_rise: float = 1.0,
        max_fall: float = 1.0,
        min_coef: float = 1e-4,
        max_coef: float = 1e3,
        kl_coef: float | None = None,
        kl_target: float | None = None,
    ) -> None:
        init_kl_coef = one_knob(type(self).__name__, "init_kl_coef", init_kl_coef, "kl_coef", kl_coef)
        target = one_knob(type(self).__name__, "target", target, "kl_target", kl_target)
        config = dict(target=target, brake_gain=brake_gain, release_gain=release_gain, lookahead=lookahead,
                      hold_growth=hold_growth, smoothing=smoothing, max_rise=max_rise, max_fall=max_fall,
                      min_coef=min_coef, max_coef=max_coef)
        self._configure(config, init_kl_coef, "init_kl_coef")
        self.last_kl: float | None = None
        self.trend = 0.0
        self.num_updates = 0
        self.models = control_targets(model)
        push_coef(self.models, self._coef)

    def _configure(self, config: dict[str, Any], coef: Any, coef_name: str) -> None:
        for name in ("target", "brake_gain", "release_gain", "max_rise", "max_fall", "min_coef"):
            setattr(self, name, real_number(name, config[name], low=0.0, low_open=True))
        self.lookahead = real_number("lookahead", config["lookahead"], low=0.0)
        self.hold_growth = real_number("hold_growth", config["hold_growth"], low=1.0, low_open=True, allow_inf=True)
        self.smoothing = real_number("smoothing", config["smoothing"], low=0.0, low_open=True, high=1.0,
                                     fix="Pass 1 for no smoothing.")
        self.max_coef = real_number("max_coef", config["max_coef"], low=self.min_coef)
        self._coef = real_number(coef_name, coef, low=self.min_coef, high=self.max_coef,
                                 fix="Start inside [min_coef, max_coef] or widen them.")

    @property
    def kl_coef(self) -> float:
        return self._coef

    coef = kl_coef  # TorchRL's attribute name, as on the other controllers

    def log_error(self, predicted: float) -> float:
        """``log(predicted / target)`` clipped to ``[-max_fall, max_rise]``; -max_fall for
        a forecast <= 0, max_rise for one that overflowed to +inf."""
        ratio = predicted / self.target
        if ratio <= 0:  # also a positive forecast that underflows the division (5e-324 / 2)
            return -self.max_fall
        return min(max(math.log(ratio), -self.max_fall), self.max_rise)

    def update(self, kl_values: Any = None, n_steps: int | None = None) -> float:
        """Moves beta after one batch and returns it; the inputs are those of
        ``AdaptiveKLController.update`` (per-sequence KLs, or their mean with ``n_steps``)."""
        return self.step(torchrl_kl(kl_values, n_steps))

    def step(self, reading: SequenceKL) -> float:
        """``update`` on a checked reading (``tether.control.kl_io.sequence_kl`` of the ``[N]`` KLs)."""
        kl = reading.mean
        if self.last_kl is not None:
            change = kl - self.last_kl
            # The first change is the trend; after that an exponential average of the changes.
            self.trend = change if self.num_updates == 1 else self.trend + self.smoothing * (change - self.trend)
            error = self.log_error(kl + self.lookahead * self.trend)
            # A KL <= 0 is on no way anywhere (and "grows" from a negative k1 mean trivially).
            on_its_way = kl > 0 and (kl + 2 * self.lookahead * self.trend >= self.target
                                     or kl >= self.hold_growth * self.last_kl)
            if error < 0 and on_its_way:
                error = 0.0  # a release now buys no speed and only weakens the brake
            gain = self.brake_gain if error > 0 else self.release_gain
            coef = self._coef * math.exp(gain * error)
            self._coef = min(max(coef, self.min_coef), self.max_coef)
        self.last_kl = kl
        self.num_updates += 1
        push_coef(self.models, self._coef)
        return self._coef

    def state_dict(self) -> dict[str, Any]:
        state = {name: getattr(self, name) for name in self._CONFIG}
        return {"kl_coef": self._coef, **state, "last_kl": self.last_kl, "trend": self.trend,
                "num_updates": self.num_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, self._STATE_KEYS, type(self).__name__)
        last_kl, count = state["last_kl"], state["num_updates"]
        if last_kl is not None:
            last_kl = real_number("last_kl", last_kl)
        trend = real_number("trend", state["trend"])
        whole_number("num_updates", count, low=0, fix="Pass a dict produced by TargetKLController.state_dict().")
        self._configure(state, state["kl_coef"], "kl_coef")
        self.last_kl, self.trend, self.num_updates = last_kl, trend, count
        push_coef(self.models, self._coef)

    def __repr__(self) -> str:
        config = ", ".join(f"{name}={getattr(self, name)}" for name in self._CONFIG)
        return f"{type(self).__name__}(kl_coef={self._coef}, {config})"
