"""KL-coefficient controllers: a constant one and the adaptive one of Ziegler et al. (2019).

The adaptive rule is the proportional controller of "Fine-Tuning Language Models from Human
Preferences" (section 2.2, as in openai/lm-human-preferences)::

    e    = clip(KL / target - 1, -0.2, 0.2)
    beta = beta * (1 + e * n_steps / horizon)

Departures from the TorchRL seed, and why:

* Units. The KL the controller compares with ``target`` is the mean over sequences of the
  *per-sequence summed* KL (nats per sequence), the quantity the paper targets. The seed fed
  it a padded per-token mean of ``-coef * kl`` and divided by ``coef`` afterwards, so the
  target silently changed meaning with the response length and the padding.
* ``n_steps`` counts sequences (the paper's batch of episodes), not queue entries.
* ``beta`` stays a plain Python float; the seed turned it into a tensor after one update.
* Arguments are validated, and the coefficient is kept inside ``[min_coef, max_coef]``.
  ``min_coef`` defaults to ``1e-6`` rather than 0: the update is multiplicative, so a
  coefficient that reaches 0 could never grow again.

A controller may drive any object exposing a read/write ``kl_coef`` attribute (reward
transforms, losses, rollout helpers), or a list/tuple of such objects, so one controller can
keep a reward penalty and a loss term in step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any, Protocol

import torch

__all__ = [
    "KL_CONTROLLERS",
    "AdaptiveKLController",
    "ConstantKLController",
    "KLController",
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


def _real(name: str, value: Any, *, minimum: float | None = None, strict: bool = False,
          allow_inf: bool = False) -> float:
    """Validates a real-valued argument and returns it as a Python float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number; got {value!r} of type {type(value).__name__}. "
            f"Pass a Python float, e.g. {name}=0.1."
        )
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be finite; got {value}. Pass a finite float.")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        relation = ">" if strict else ">="
        raise ValueError(
            f"{name} must be {relation} {minimum}; got {value}. Pass a value {relation} {minimum}."
        )
    return value


def _control_targets(model: Any) -> tuple[Any, ...]:
    """Normalises ``model`` (None, one object or a list/tuple) and checks each has ``kl_coef``."""
    if model is None:
        return ()
    targets = tuple(model) if isinstance(model, (list, tuple)) else (model,)
    for index, target in enumerate(targets):
        if not hasattr(target, "kl_coef"):
            where = f"model[{index}]" if isinstance(model, (list, tuple)) else "model"
            raise TypeError(
                f"{where} must expose a read/write `kl_coef` attribute; got an object of type "
                f"{type(target).__name__} without one. Pass the component whose KL term the "
                f"controller should drive (e.g. a KLRewardTransform or a loss with kl_coef)."
            )
    return targets


def _push_coef(targets: tuple[Any, ...], coef: float) -> None:
    """Writes ``coef`` to every driven object, turning a read-only attribute into a clear error."""
    for target in targets:
        try:
            target.kl_coef = coef
        except AttributeError as err:
            raise TypeError(
                f"model.kl_coef of {type(target).__name__} is read-only; the controller needs "
                f"to write it. Give that class a `kl_coef` setter."
            ) from err


def _positive_count(n_steps: Any) -> int:
    if isinstance(n_steps, bool) or not isinstance(n_steps, numbers.Integral) or n_steps <= 0:
        raise ValueError(
            f"n_steps must be a positive int (the number of sequences the KL was measured on); "
            f"got {n_steps!r}. Pass the batch size in sequences."
        )
    return int(n_steps)


def _mean_sequence_kl(kl_values: Any, n_steps: int | None) -> tuple[float, int]:
    """Returns (mean per-sequence KL, number of sequences) from the accepted input forms.

    ``kl_values`` is a 1-D tensor ``[N]`` or a sequence of N numbers (each the KL of one
    sequence summed over its tokens), or a scalar already averaged over ``n_steps``
    sequences, in which case ``n_steps`` is required.
    """
    if kl_values is None:
        raise ValueError(
            "kl_values is required by AdaptiveKLController.update; got None. Pass the "
            "per-sequence summed KLs of the last batch (a 1-D tensor or list), or their mean "
            "together with n_steps."
        )
    if isinstance(kl_values, torch.Tensor):
        values = kl_values.detach().to(device="cpu", dtype=torch.float64)
    elif isinstance(kl_values, numbers.Real) and not isinstance(kl_values, bool):
        values = torch.tensor(float(kl_values), dtype=torch.float64)
    elif isinstance(kl_values, Iterable) and not isinstance(kl_values, (str, bytes)):
        try:
            # float() takes numbers and one-element tensors alike (e.g. a deque of 0-dim KLs).
            values = torch.tensor([float(v) for v in kl_values], dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(
                f"kl_values must contain one number per sequence; could not read it as "
                f"floats ({err}). Pass a 1-D tensor or a list of floats."
            ) from err
    else:
        raise TypeError(
            f"kl_values must be a 1-D tensor, a sequence of floats or a scalar; got "
            f"{type(kl_values).__name__}. Pass the per-sequence summed KLs."
        )
    if values.dim() > 1:
        raise ValueError(
            f"kl_values must hold one KL per sequence (shape [N]); got shape "
            f"{tuple(values.shape)}. Sum the per-token KL over each sequence's valid tokens "
            f"first, e.g. (kl * mask).sum(-1)."
        )
    if values.dim() == 0:
        if n_steps is None:
            raise ValueError(
                "n_steps is required when kl_values is a scalar mean; got None. Pass the "
                "number of sequences that mean was taken over."
            )
        count = _positive_count(n_steps)
    else:
        if values.numel() == 0:
            raise ValueError("kl_values is empty; expected at least one per-sequence KL.")
        count = values.numel()
        if n_steps is not None and _positive_count(n_steps) != count:
            raise ValueError(
                f"n_steps={n_steps} disagrees with len(kl_values)={count}; n_steps counts the "
                f"sequences in kl_values. Omit n_steps when passing one KL per sequence."
            )
    mean = float(values.mean())
    if not math.isfinite(mean):
        raise ValueError(
            f"kl_values must be finite; got a mean of {mean}. Check the log-probs for -inf "
            f"(e.g. a reference model that gives a sampled token zero probability)."
        )
    return mean, count


def _check_state_keys(state: dict[str, Any], expected: tuple[str, ...], owner: str) -> None:
    missing = [key for key in expected if key not in state]
    extra = [key for key in state if key not in expected]
    if missing or extra:
        raise KeyError(
            f"{owner}.load_state_dict expected keys {list(expected)}; missing {missing}, "
            f"unexpected {extra}. Pass a dict produced by {owner}.state_dict()."
        )


class ConstantKLController:
    """Keeps the KL coefficient fixed, whatever KL it is shown.

    Args:
        kl_coef: the coefficient (>= 0).
        model: optional object, or list/tuple of objects, with a read/write ``kl_coef``;
            each receives ``kl_coef`` at construction and on every ``update``.
    """

    def __init__(self, *, kl_coef: float, model: Any = None) -> None:
        self._coef = _real("kl_coef", kl_coef, minimum=0.0)
        self.models = _control_targets(model)
        _push_coef(self.models, self._coef)

    @property
    def kl_coef(self) -> float:
        return self._coef

    coef = kl_coef  # the seed's attribute name

    def update(self, kl_values: Any = None, n_steps: int | None = None) -> float:
        """Returns the (unchanged) coefficient and re-writes it to the driven objects.

        ``kl_values`` and ``n_steps`` are accepted so both controllers share one call site;
        a constant controller does not use them.
        """
        _push_coef(self.models, self._coef)
        return self._coef

    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self._coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state_keys(state, ("kl_coef",), type(self).__name__)
        self._coef = _real("kl_coef", state["kl_coef"], minimum=0.0)
        _push_coef(self.models, self._coef)

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

    Example (the worked check of the spec):
        >>> ctl = AdaptiveKLController(init_kl_coef=0.15, target=6.0, horizon=10_000)
        >>> round(ctl.update(torch.full((512,), 12.0)), 6)
        0.151536
    """

    _STATE_KEYS = ("kl_coef", "target", "horizon", "min_coef", "max_coef")

    def __init__(
        self,
        *,
        init_kl_coef: float,
        target: float,
        horizon: float,
        model: Any = None,
        min_coef: float = 1e-6,
        max_coef: float = math.inf,
    ) -> None:
        self._set_config(init_kl_coef, target, horizon, min_coef, max_coef, "init_kl_coef")
        self.models = _control_targets(model)
        _push_coef(self.models, self._coef)

    def _set_config(self, coef: Any, target: Any, horizon: Any, min_coef: Any,
                    max_coef: Any, coef_name: str) -> None:
        target = _real("target", target, minimum=0.0, strict=True)
        horizon = _real("horizon", horizon, minimum=0.0, strict=True)
        min_coef = _real("min_coef", min_coef, minimum=0.0)
        max_coef = _real("max_coef", max_coef, allow_inf=True)
        coef = _real(coef_name, coef)
        if not min_coef <= coef <= max_coef:
            raise ValueError(
                f"{coef_name} must lie in [min_coef, max_coef] = [{min_coef}, {max_coef}]; "
                f"got {coef}. Choose bounds that contain the starting coefficient (a start "
                f"of 0 can never grow: use a small positive value)."
            )
        self._coef, self.target, self.horizon = coef, target, horizon
        self.min_coef, self.max_coef = min_coef, max_coef

    @property
    def kl_coef(self) -> float:
        return self._coef

    coef = kl_coef  # the seed's attribute name

    def update(self, kl_values: Any = None, n_steps: int | None = None) -> float:
        """Moves the coefficient after one batch and returns it (a Python float).

        Args:
            kl_values: per-sequence summed KLs of the batch, ``[N]`` tensor or sequence of
                floats (nats per sequence); or a scalar, their mean, with ``n_steps``.
            n_steps: number of sequences; defaults to ``len(kl_values)``.
        """
        mean_kl, count = _mean_sequence_kl(kl_values, n_steps)
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
        _push_coef(self.models, self._coef)
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
        _check_state_keys(state, self._STATE_KEYS, type(self).__name__)
        self._set_config(state["kl_coef"], state["target"], state["horizon"],
                         state["min_coef"], state["max_coef"], "kl_coef")
        _push_coef(self.models, self._coef)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(kl_coef={self._coef}, target={self.target}, "
            f"horizon={self.horizon}, min_coef={self.min_coef}, max_coef={self.max_coef})"
        )


KL_CONTROLLERS: dict[str, type] = {
    "constant": ConstantKLController,
    "adaptive": AdaptiveKLController,
}


def make_kl_controller(name: str, **kwargs: Any) -> KLController:
    """Builds a controller from its registry name (for configs), e.g. ``"adaptive"``."""
    try:
        cls = KL_CONTROLLERS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown KL controller {name!r}; supported: {sorted(KL_CONTROLLERS)}. "
            f"Pick one of those names."
        ) from None
    return cls(**kwargs)
