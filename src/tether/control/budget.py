"""``BudgetKLController``: holds the KL budget by moving the update itself, and beta slowly.

After each optimizer step the recipe hands ``hold`` a function that measures the mean KL per
answer of the weights ``theta_ref + s * (theta - theta_ref)`` on the step's batch (one policy
forward each). When the updated weights (``s = 1``) leave the band, ``hold`` searches the
scale ``s`` that lands on the target: ``s < 1`` pulls the policy toward the reference (WARP's
interpolation, arXiv 2406.16768), ``s > 1`` pushes it out when the KL lags below the band.
``s = 0`` is the reference, KL 0, so a move under the band's top always exists: when the
search runs out of forwards it keeps the largest measured scale under the top, else 0.
The search models the KL as ``c * s**p`` (``p = 2`` at first: the KL is quadratic in the
weights around the reference), refits ``p`` from the last two measurements and keeps a
bracket; TRPO's backtracking line search is the other anchor, here aimed at a target.

beta stays the penalty that shapes each update's direction, and adapts slowly: a PI rule on
``log beta`` driven by ``e = log(kl_before / target)``. ``ReferenceLine`` holds the line: a LoRA
policy whose reference is its adapter switched off scales each ``lora_B`` by ``s`` (exact);
any other reference is paired parameter by parameter, shard by shard under FSDP2. The
measured choices (scales toward the reference; Adam's moments kept) are on the leash page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from tether.control.kl_io import check_state_keys, control_targets, mean_sequence_kl, push_coef
from tether.models.reference import AdapterDisabledReference, tracked_pairs
from tether.ops.checks import real_number, whole_number

__all__ = ["BudgetKLController", "BudgetMove", "ReferenceLine"]


@dataclass(frozen=True)
class BudgetMove:
    """One step's move: the KL per answer before and after it, the scale kept, forwards spent."""

    kl_before: float
    kl_after: float
    scale: float
    forwards: int

    def metrics(self) -> dict[str, float]:
        return {"kl_move_before_per_seq": self.kl_before, "kl_move_after_per_seq": self.kl_after,
                "kl_move_scale": self.scale, "kl_move_forwards": float(self.forwards)}


class BudgetKLController:
    """Keeps the mean per-answer KL inside ``target * (1 +- band)`` by scaling each update.

    Args:
        init_kl_coef: starting beta, inside ``[min_coef, max_coef]``.
        target: the KL to hold, in nats per answer (> 0).
        model: optional object, or list/tuple of objects, with a read/write ``kl_coef``.
        band: half-width of the band as a fraction of ``target``, in ``(0, 1)``; the weights
            move when the updated KL leaves ``[target * (1 - band), target * (1 + band / 2)]``
            and the search stops within ``target * (1 +- band / 2)``.
        max_scale: largest scale a lagging KL may be pushed out by (>= 1; 1 never pushes).
        max_forwards: most KL measurements a step (>= 2: the updated weights and one move).
        gain, integral_gain: the PI gains on ``log beta`` (>= 0); beta moves by at most
            ``exp(gain + integral_gain)`` a step (the error is clipped to +-1).
        min_coef, max_coef: bounds on beta, ``0 < min_coef <= max_coef``.
    """

    _CONFIG = ("target", "band", "max_scale", "max_forwards", "gain", "integral_gain", "min_coef", "max_coef")
    _STATE_KEYS = ("kl_coef", *_CONFIG, "integral", "power")

    def __init__(self, *, init_kl_coef: float, target: float, model: Any = None, band: float = 0.25,
                 max_scale: float = 4.0, max_forwards: int = 4, gain: float = 0.5, integral_gain: float = 0.25,
                 min_coef: float = 1e-4, max_coef: float = 1e3) -> None:
        self._configure(dict(target=target, band=band, max_scale=max_scale, max_forwards=max_forwards, gain=gain,
                             integral_gain=integral_gain, min_coef=min_coef, max_coef=max_coef))
        self._coef = real_number("init_kl_coef", init_kl_coef, low=self.min_coef, high=self.max_coef,
                                 fix="Start inside [min_coef, max_coef] or widen them.")
        self.integral = math.log(self._coef)  # the I part of log beta
        self.power = 2.0  # the KL's exponent in the scale, refitted by every search
        self.models = control_targets(model)
        push_coef(self.models, self._coef)

    def _configure(self, config: dict[str, Any]) -> None:
        self.target = real_number("target", config["target"], low=0.0, low_open=True)
        self.band = real_number("band", config["band"], low=0.0, low_open=True, high=1.0, high_open=True)
        self.max_scale = real_number("max_scale", config["max_scale"], low=1.0, fix="1 never pushes the KL up.")
        self.max_forwards = whole_number("max_forwards", config["max_forwards"], low=2,
                                         fix="One measures the updated weights, one a move.")
        self.gain = real_number("gain", config["gain"], low=0.0)
        self.integral_gain = real_number("integral_gain", config["integral_gain"], low=0.0)
        self.min_coef = real_number("min_coef", config["min_coef"], low=0.0, low_open=True)
        self.max_coef = real_number("max_coef", config["max_coef"], low=self.min_coef)

    @property
    def kl_coef(self) -> float:
        return self._coef

    coef = kl_coef

    # ------------------------------------------------------------------ beta
    def update(self, kl_values: Any = None, n_steps: int | None = None) -> float:
        """PI step of ``log beta`` on ``log(KL / target)`` (inputs as ``AdaptiveKLController.update``)."""
        kl, _ = mean_sequence_kl(kl_values, n_steps)
        error = 1.0 if kl > 0 and math.isinf(kl) else min(max(math.log(max(kl, 1e-12) / self.target), -1.0), 1.0)
        low, high = math.log(self.min_coef), math.log(self.max_coef)
        self.integral = min(max(self.integral + self.integral_gain * error, low), high)  # no wind-up past a bound
        self._coef = min(max(math.exp(self.integral + self.gain * error), self.min_coef), self.max_coef)
        push_coef(self.models, self._coef)
        return self._coef

    # ------------------------------------------------------------------ the move
    def hold(self, move: Callable[[float], None], measure: Callable[[], float]) -> BudgetMove:
        """Measure the updated weights; if their KL left the band, move them into it; step beta.

        ``move(s)`` sets the weights to ``theta_ref + s * (theta - theta_ref)`` of the updated
        ``theta`` (``move(1.0)`` restores them exactly); ``measure()`` returns the current
        weights' mean KL per answer. Weights the band holds are never touched."""
        kl_before = measure()
        points = {1.0: kl_before}
        act_low = self.target * (1 - self.band) if self.max_scale > 1 else -math.inf
        scale = 1.0
        if not act_low <= kl_before <= self.target * (1 + self.band / 2):
            scale = self._search(move, measure, points)
        self.update(torch.tensor([kl_before], dtype=torch.float64))
        return BudgetMove(kl_before, points.get(scale, 0.0), scale, len(points))

    def _search(self, move: Callable[[float], None], measure: Callable[[], float], points: dict[float, float]) -> float:
        """The scale kept: the first measured within ``target * (1 +- band / 2)``; failing that,
        the largest measured under the band's top, or 0 (the reference) when none is."""
        near, top = self.target * self.band / 2, self.target * (1 + self.band)
        lo, hi, last = 0.0, math.inf, 1.0  # KL(lo) <= target < KL(hi); KL(0) = 0
        while len(points) < self.max_forwards:
            kl = points[last]
            lo, hi = (lo, min(hi, last)) if kl > self.target else (max(lo, last), hi)
            guess = min(last * (self.target / kl) ** (1 / self.power) if kl > 0 else math.inf, self.max_scale)
            if not lo < guess < hi:
                guess = (lo + hi) / 2 if math.isfinite(hi) else self.max_scale
            if guess in points:
                break  # pushed to max_scale and still under the target
            move(guess)
            points[guess] = measure()
            if points[guess] > 0 and kl > 0:  # refit the exponent on the last two points
                self.power = min(max(math.log(points[guess] / kl) / math.log(guess / last), 0.5), 4.0)
            last = guess
            if abs(points[guess] - self.target) <= near:
                return guess
        under = [s for s, kl in points.items() if kl <= top]
        best = max(under, key=lambda s: (abs(points[s] - self.target) <= near, s)) if under else 0.0
        if best != last:
            move(best)
        return best

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"kl_coef": self._coef, **{name: getattr(self, name) for name in self._CONFIG},
                "integral": self.integral, "power": self.power}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, self._STATE_KEYS, type(self).__name__)
        self._configure(state)
        self._coef = real_number("kl_coef", state["kl_coef"], low=self.min_coef, high=self.max_coef)
        self.integral = real_number("integral", state["integral"])
        self.power = real_number("power", state["power"], low=0.0, low_open=True)
        push_coef(self.models, self._coef)

    def __repr__(self) -> str:
        config = ", ".join(f"{name}={getattr(self, name)}" for name in self._CONFIG)
        return f"{type(self).__name__}(kl_coef={self._coef}, {config})"


class ReferenceLine:
    """The trainable weights of ``policy`` on the line from ``reference`` through their current values."""

    def __init__(self, policy: nn.Module, reference: nn.Module) -> None:
        if isinstance(reference, AdapterDisabledReference):
            self._pairs = _adapter_pairs(policy)
        else:
            self._pairs = [(param, anchor) for param, anchor in tracked_pairs(policy, reference).values()]
        self._captured: list[torch.Tensor] | None = None

    @torch.no_grad()
    def capture(self) -> None:
        """Take the current weights as ``s = 1`` (a copy of each moved tensor)."""
        self._captured = [param.detach().clone() for param, _ in self._pairs]

    @torch.no_grad()
    def place(self, scale: float) -> None:
        """Set the weights to ``theta_ref + scale * (captured - theta_ref)``."""
        if self._captured is None:
            raise RuntimeError("ReferenceLine.place: nothing captured; call capture() after the optimizer step first.")
        for (param, anchor), value in zip(self._pairs, self._captured):
            if scale == 1.0:
                param.copy_(value)
            elif anchor is None:
                param.copy_(value * scale)
            else:
                param.copy_(torch.lerp(anchor.to(value.dtype), value, scale))


def _adapter_pairs(policy: nn.Module) -> list[tuple[torch.Tensor, None]]:
    """The ``lora_B`` factors of a policy whose reference is its adapter switched off (anchor 0)."""
    pairs, other = [], []
    for name, param in policy.named_parameters():
        if not param.requires_grad:
            continue
        if "lora_B" in name:
            pairs.append((param, None))
        elif "lora_A" not in name:
            other.append(name)
    if other or not pairs:
        raise ValueError(
            f"policy: the KL budget moves a LoRA policy along the line from its adapter-free reference by "
            f"scaling lora_B, but trainable parameters {other[:3] or 'none named lora_B'} are not LoRA factors; "
            "train only LoRA factors, or use a frozen_copy reference (lora_rank=0 or reference_update=sync)."
        )
    return pairs
