"""KL-coefficient controllers: constant, Ziegler et al.'s adaptive one (2019), and the registry
that also names ``TargetKLController`` and ``BudgetKLController``.

The adaptive rule is the proportional controller of "Fine-Tuning Language Models from Human
Preferences" (section 2.2, as in openai/lm-human-preferences)::

    e    = clip(KL / target - 1, -0.2, 0.2)
    beta = beta * (1 + e * n_steps / horizon)

Departures from TorchRL, and why:

* Units. The KL the controller compares with ``target`` is the mean over sequences of the
  *per-sequence summed* KL (nats per sequence), the quantity the paper targets. The seed fed
  it a padded per-token mean of ``-coef * kl`` and divided by ``coef`` afterwards, so the
  target silently changed meaning with the response length and the padding.
* ``n_steps`` counts sequences (the paper's batch of episodes), not queue entries.
* ``beta`` stays a Python float; arguments are validated; ``min_coef`` defaults to ``1e-6``,
  not 0, since a multiplicative update cannot move a coefficient away from 0.

A controller drives any object (or list of objects) with a read/write ``kl_coef``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Protocol

from tether.control.budget import BudgetKLController
from tether.control.kl_io import (
    SequenceKL,
    check_state_keys,
    control_targets,
    one_knob,
    push_coef,
    torchrl_kl,
)
from tether.control.target import TargetKLController
from tether.ops.checks import lookup, real_number

__all__ = [
    "KL_CONTROLLERS",
    "AdaptiveKLController",
    "BudgetKLController",
    "ConstantKLController",
    "KLController",
    "TargetKLController",
    "make_kl_controller",
]

# Bound on the proportional error, from the paper; it caps how fast beta can move per update.
_ERROR_CLIP = 0.2


class KLController(Protocol):
    """What the rest of tether expects from a KL controller (structural, no base class)."""

    @property
    def kl_coef(self) -> float: ...

    def update(self, kl_values: Any = None, n_steps: int | None = None) -> float: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ConstantKLController:
    """Keeps the KL coefficient fixed, whatever KL it is shown.

    Args:
        kl_coef: the coefficient (>= 0).
        model: optional object, or list/tuple of objects, with a read/write ``kl_coef``;
            each receives ``kl_coef`` at construction and on every ``update``.

    Examples:
        >>> ctl = ConstantKLController(kl_coef=0.05)
        >>> ctl.update([10.0, 0.0])  # whatever KL it is shown
        0.05
    """

    def __init__(self, *, kl_coef: float | None = None, model: Any = None, init_kl_coef: float | None = None) -> None:
        kl_coef = one_knob(type(self).__name__, "kl_coef", kl_coef, "init_kl_coef", init_kl_coef)
        self._coef = real_number("kl_coef", kl_coef, low=0.0)
        self.models = control_targets(model)
        push_coef(self.models, self._coef)

    @property
    def kl_coef(self) -> float:
        return self._coef

    coef = kl_coef  # TorchRL's attribute name

    def update(self, kl_values: Any = None, n_steps: int | None = None) -> float:
        """Returns the (unchanged) coefficient and re-writes it to the driven objects.

        ``kl_values`` and ``n_steps`` are accepted so both controllers share one call site;
        a constant controller does not use them.
        """
        push_coef(self.models, self._coef)
        return self._coef

    def step(self, kl: SequenceKL) -> float:
        """``update`` on a checked reading (which it ignores)."""
        return self.update()

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self._coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, ("kl_coef",), type(self).__name__)
        self._coef = real_number("kl_coef", state["kl_coef"], low=0.0)
        push_coef(self.models, self._coef)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kl_coef={self._coef})"


class AdaptiveKLController:
    """Adapts the KL coefficient towards a target per-sequence KL (Ziegler et al. 2019).

    Args:
        init_kl_coef: starting coefficient, inside ``[min_coef, max_coef]``.
        target: target KL in nats per sequence (> 0): the mean over sequences of the KL
            summed over each sequence's tokens.
        horizon: number of sequences over which a persistent error changes the
            coefficient by about ``e`` (> 0). Each update needs ``horizon > 0.2 * n_steps``
            so the multiplier ``1 + e * n_steps / horizon`` stays positive.
        model: optional object, or list/tuple of objects, with a read/write ``kl_coef``;
            each receives the coefficient at construction and after every update.
        min_coef: lower bound (>= 0), default ``1e-6``: positive because an update cannot
            move a coefficient away from 0.
        max_coef: upper bound, default ``inf`` (unbounded, as in the paper).

    Examples:
        The worked check of the spec (KL 12 over 512 answers, twice the target):

        >>> import torch
        >>> ctl = AdaptiveKLController(init_kl_coef=0.15, target=6.0, horizon=10_000)
        >>> round(ctl.update(torch.full((512,), 12.0)), 6)
        0.151536
    """

    _STATE_KEYS = ("kl_coef", "target", "horizon", "min_coef", "max_coef")

    def __init__(
        self,
        *,
        init_kl_coef: float | None = None,
        target: float | None = None,
        horizon: float | None = None,
        model: Any = None,
        min_coef: float = 1e-6,
        max_coef: float = math.inf,
        kl_coef: float | None = None,
        kl_target: float | None = None,
        kl_horizon: float | None = None,
    ) -> None:
        owner = type(self).__name__
        init_kl_coef = one_knob(owner, "init_kl_coef", init_kl_coef, "kl_coef", kl_coef)
        target = one_knob(owner, "target", target, "kl_target", kl_target)
        horizon = one_knob(owner, "horizon", horizon, "kl_horizon", kl_horizon)
        self._set_config(init_kl_coef, target, horizon, min_coef, max_coef, "init_kl_coef")
        self.models = control_targets(model)
        push_coef(self.models, self._coef)

    def _set_config(self, coef: Any, target: Any, horizon: Any, min_coef: Any,
                    max_coef: Any, coef_name: str) -> None:
        target = real_number("target", target, low=0.0, low_open=True)
        horizon = real_number("horizon", horizon, low=0.0, low_open=True)
        min_coef = real_number("min_coef", min_coef, low=0.0)
        max_coef = real_number("max_coef", max_coef, allow_inf=True)
        coef = real_number(coef_name, coef, low=min_coef, high=max_coef,
                           fix="Choose [min_coef, max_coef] to contain the starting coefficient (a start of 0 "
                               "can never grow: use a small positive value).")
        self._coef, self.target, self.horizon = coef, target, horizon
        self.min_coef, self.max_coef = min_coef, max_coef

    @property
    def kl_coef(self) -> float:
        return self._coef

    coef = kl_coef  # TorchRL's attribute name

    def update(self, kl_values: Any = None, n_steps: int | None = None) -> float:
        """Moves the coefficient after one batch and returns it (a Python float).

        Args:
            kl_values: per-sequence summed KLs of the batch, ``[N]`` tensor or sequence of
                floats (nats per sequence); or a scalar, their mean, with ``n_steps``.
            n_steps: number of sequences; defaults to ``len(kl_values)``.
        """
        return self.step(torchrl_kl(kl_values, n_steps))

    def step(self, kl: SequenceKL) -> float:
        """``update`` on a checked reading (``tether.control.kl_io.sequence_kl`` of the ``[N]`` KLs)."""
        mean_kl, count = kl.mean, kl.count
        step = count / self.horizon
        if _ERROR_CLIP * step >= 1.0:
            raise ValueError(
                f"n_steps / horizon = {count} / {self.horizon} is too large: the multiplier "
                f"1 + e * n_steps / horizon could reach <= 0 for e = -{_ERROR_CLIP}. Use "
                f"horizon > {count * _ERROR_CLIP:g} (typically thousands of sequences)."
            )
        error = min(max(mean_kl / self.target - 1.0, -_ERROR_CLIP), _ERROR_CLIP)
        new_coef = self._coef * (1.0 + error * step)
        # The bounds are part of the configuration (documented), not a stability patch.
        self._coef = min(max(new_coef, self.min_coef), self.max_coef)
        push_coef(self.models, self._coef)
        return self._coef

    def state_dict(self) -> dict[str, Any]:
        return {
            "kl_coef": self._coef,
            "target": self.target,
            "horizon": self.horizon,
            "min_coef": self.min_coef,
            "max_coef": self.max_coef,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, self._STATE_KEYS, type(self).__name__)
        self._set_config(state["kl_coef"], state["target"], state["horizon"],
                         state["min_coef"], state["max_coef"], "kl_coef")
        push_coef(self.models, self._coef)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(kl_coef={self._coef}, target={self.target}, "
            f"horizon={self.horizon}, min_coef={self.min_coef}, max_coef={self.max_coef})"
        )


KL_CONTROLLERS: dict[str, type] = {
    "constant": ConstantKLController,
    "adaptive": AdaptiveKLController,
    "target": TargetKLController,
    "budget": BudgetKLController,
}


def make_kl_controller(name: str, **kwargs: Any) -> KLController:
    """Builds a controller from its registry name (for configs), e.g. ``"target"``.

    Keywords take the configuration's names (``kl_coef``, ``kl_target``, ``kl_horizon``, as in
    ``tether train``) or the constructors' (TorchRL's ``init_kl_coef``, ``target``,
    ``horizon``; ``ConstantKLController`` spells its one coefficient ``kl_coef``), as the
    constructors do. One knob given under both names is a ``TypeError`` naming both; a keyword
    the controller lacks, one listing what it takes.

    Examples:
        >>> make_kl_controller("target", kl_coef=0.1, kl_target=3.0).target
        3.0
        >>> make_kl_controller("adaptive", init_kl_coef=0.15, target=6.0, horizon=10_000).kl_coef
        0.15
        >>> make_kl_controller("constant", init_kl_coef=0.05).kl_coef
        0.05
        >>> make_kl_controller("budget", kl_coef=0.1, kl_target=3.0).target
        3.0
    """
    cls = lookup(KL_CONTROLLERS, name, "name")
    taken = [p for p in inspect.signature(cls).parameters if p != "self"]
    unknown = [key for key in kwargs if key not in taken]
    if unknown:
        raise TypeError(f"make_kl_controller({name!r}): unknown argument {unknown[0]!r}; it takes {', '.join(taken)}.")
    return cls(**kwargs)
