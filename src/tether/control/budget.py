"""``BudgetKLController``: holds the KL budget by moving the update itself, and beta slowly.

After each optimizer step ``hold`` reads the mean KL per answer of the updated weights on the
step's batch. Outside the band it searches the scale ``s`` of ``theta_ref + s (theta - theta_ref)``
that lands on the target (WARP's interpolation, arXiv 2406.16768, aimed at a KL; TRPO's
backtracking is the other anchor), modelling the KL as ``c s**p`` with ``p`` refitted from the
last two readings. ``s > 1`` pushes a lagging KL out, only with ``push``. A search that finds no
scale under the band's top rejects the update: the weights and optimizer state the step started
from are kept, never the reference. Whatever was kept, a ceiling (``kl_bound``) is then enforced
with readings over every answer, pulling the kept weights back along their own line.

beta stays the penalty that shapes each update's direction and adapts slowly: a PI rule on
``log beta`` driven by ``log(kl_before / target)``. ``ReferenceLine`` holds the weights' line for
a model: a LoRA policy whose reference is its adapter switched off scales each ``lora_B``
(exact); any other reference is paired parameter by parameter, shard by shard under FSDP2.
Measurements behind each choice are on the leash page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import nn

from tether.control.kl_io import SequenceKL, check_state_keys, control_targets, one_knob, push_coef, torchrl_kl
from tether.models.reference import AdapterDisabledReference, tracked_pairs
from tether.ops.checks import real_number, whole_number

__all__ = ["BudgetKLController", "BudgetMove", "Line", "ReferenceLine", "pull_under_ceiling"]

# Readings the ceiling may spend pulling kept weights back; each aims under the ceiling, so one
# is the rule (the KL shrinks with the scale) and a curve that does not shrink is an error.
CEILING_READINGS = 8
# A pull lands this far under the ceiling when its aim does not ask for less: one reading's margin.
CEILING_AIM = 0.9


class Line(Protocol):
    """The weights the controller moves: points ``anchor + s * (candidate - anchor)``."""

    def capture(self) -> None:
        """Take the current weights as the candidate (``s = 1``)."""

    def place(self, scale: float) -> None:
        """Set the weights to ``anchor + scale * (candidate - anchor)``."""

    def reject(self) -> None:
        """Set the weights (and optimizer state) back to the step's start; they become the candidate."""


Measure = Callable[..., float]  # measure(full: bool = False) -> mean KL per answer of the current weights


@dataclass(frozen=True)
class BudgetMove:
    """One step's leash: the KL per answer of the updated weights and of the weights kept, the scale
    kept on the candidate's line (the update's, or the step's start when rejected), readings spent."""

    kl_before: float
    kl_kept: float
    scale: float
    forwards: int
    rejected: bool = False
    seconds: float = 0.0  # what the leash cost the step, set by the trainer that timed it

    def metrics(self) -> dict[str, Any]:
        return {"kl_move_before_per_seq": self.kl_before, "kl_kept_per_seq": self.kl_kept,
                "kl_move_scale": self.scale, "kl_move_forwards": float(self.forwards),
                "step_rejected": self.rejected, "kl_move_seconds": self.seconds}


def _finite(kl: float, what: str) -> float:
    if not math.isfinite(kl):
        raise ValueError(
            f"KL leash: the reading of {what} is {kl}; the weights were not moved by it. A non-finite KL "
            "comes from non-finite weights (lower learning_rate, set grad_clip) or a reference whose log-probs "
            "are -inf at an answer token (check the reference model and the temperature).")
    return kl


class BudgetKLController:
    """Keeps the mean per-answer KL inside ``target * (1 +- band)`` by scaling each update.

    Args:
        init_kl_coef: starting beta, inside ``[min_coef, max_coef]``.
        target: the KL to hold, in nats per answer (> 0).
        model: optional object, or list/tuple of objects, with a read/write ``kl_coef``.
        band: half-width of the band as a fraction of ``target``, in ``(0, 1)``; the weights
            move when the updated KL leaves ``[target * (1 - band), target * (1 + band / 2)]``
            (below only with ``push``) and the search stops within ``target * (1 +- band / 2)``.
        push: whether a KL lagging under the band is pushed out (scales above 1).
        max_scale: largest scale a push may reach (>= 1).
        max_forwards: most KL readings the search spends (>= 2: the updated weights and one move).
        gain, integral_gain: the PI gains on ``log beta`` (>= 0); beta moves by at most
            ``exp(gain + integral_gain)`` a step (the error is clipped to +-1).
        min_coef, max_coef: bounds on beta, ``0 < min_coef <= max_coef``.
        kl_coef, kl_target: tether train's names for ``init_kl_coef`` and ``target``; give one of each pair.

    Examples:
        Weights on a line whose KL is ``8 s**2``: the update reads 8 at target 2, outside the band,
        and the first guess ``s = (2 / 8)**(1/2) = 0.5`` lands on 2; beta steps up by
        ``exp(0.5 + 0.25)`` (the error ``log(8 / 2)`` clipped to 1).

        >>> ctl = BudgetKLController(kl_coef=0.1, kl_target=2.0)
        >>> class Line:  # a user's loop implements these three on its model (tether: ReferenceLine)
        ...     scale = 1.0
        ...     def capture(self): pass
        ...     def place(self, scale): self.scale = scale
        ...     def reject(self): self.scale = 1.0
        >>> line = Line()
        >>> move = ctl.hold(line, lambda full=False: 8.0 * line.scale ** 2)
        >>> move.scale, move.kl_kept, move.rejected
        (0.5, 2.0, False)
        >>> round(ctl.kl_coef, 6)
        0.2117
    """

    _CONFIG = ("target", "band", "push", "max_scale", "max_forwards", "gain", "integral_gain", "min_coef",
               "max_coef")
    _STATE_KEYS = ("kl_coef", *_CONFIG, "integral", "power")

    def __init__(self, *, init_kl_coef: float | None = None, target: float | None = None, model: Any = None,
                 band: float = 0.25, push: bool = False, max_scale: float = 4.0, max_forwards: int = 4,
                 gain: float = 0.5, integral_gain: float = 0.25, min_coef: float = 1e-4, max_coef: float = 1e3,
                 kl_coef: float | None = None, kl_target: float | None = None) -> None:
        owner = type(self).__name__
        init_kl_coef = one_knob(owner, "init_kl_coef", init_kl_coef, "kl_coef", kl_coef)
        target = one_knob(owner, "target", target, "kl_target", kl_target)
        self._configure(dict(target=target, band=band, push=push, max_scale=max_scale, max_forwards=max_forwards,
                             gain=gain, integral_gain=integral_gain, min_coef=min_coef, max_coef=max_coef))
        self._coef = real_number("init_kl_coef", init_kl_coef, low=self.min_coef, high=self.max_coef,
                                 fix="Start inside [min_coef, max_coef] or widen them.")
        self.integral = math.log(self._coef)  # the I part of log beta
        self.power = 2.0  # the KL's exponent in the scale, refitted by every search
        self.models = control_targets(model)
        push_coef(self.models, self._coef)

    def _configure(self, config: dict[str, Any]) -> None:
        self.target = real_number("target", config["target"], low=0.0, low_open=True)
        self.band = real_number("band", config["band"], low=0.0, low_open=True, high=1.0, high_open=True)
        if not isinstance(config["push"], bool):
            raise TypeError(f"push: expected True or False, got {config['push']!r}; pass a bool.")
        self.push = config["push"]
        self.max_scale = real_number("max_scale", config["max_scale"], low=1.0, fix="push=False never pushes.")
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

    @property
    def top(self) -> float:
        """The band's top, ``target * (1 + band)``: the most a search may keep."""
        return self.target * (1 + self.band)

    # ------------------------------------------------------------------ beta
    def update(self, kl_values: Any = None, n_steps: int | None = None) -> float:
        """PI step of ``log beta`` on ``log(KL / target)`` (inputs as ``AdaptiveKLController.update``)."""
        return self.step(torchrl_kl(kl_values, n_steps))

    def step(self, reading: SequenceKL) -> float:
        """``update`` on a checked reading (``tether.control.kl_io.sequence_kl`` of the ``[N]`` KLs)."""
        kl = reading.mean
        error = 1.0 if kl > 0 and math.isinf(kl) else min(max(math.log(max(kl, 1e-12) / self.target), -1.0), 1.0)
        low, high = math.log(self.min_coef), math.log(self.max_coef)
        self.integral = min(max(self.integral + self.integral_gain * error, low), high)  # no wind-up past a bound
        self._coef = min(max(math.exp(self.integral + self.gain * error), self.min_coef), self.max_coef)
        push_coef(self.models, self._coef)
        return self._coef

    # ------------------------------------------------------------------ the move
    def hold(self, line: Line, measure: Measure, *, ceiling: float = math.inf) -> BudgetMove:
        """Read the updated weights; if their KL left the band, move them into it (or reject the
        update); keep them under ``ceiling``; step beta from the updated weights' KL.

        ``measure(full=False)`` returns the current weights' mean KL per answer; ``full=True``
        asks for a reading over every answer (a cheaper estimate may answer ``full=False``).
        Weights the band holds are never touched, and nothing moves before a reading is finite."""
        kl_before = _finite(measure(full=True), "the updated weights")
        points = {1.0: kl_before}
        scale, kept, rejected = 1.0, kl_before, False
        low = self.target * (1 - self.band) if self.push else -math.inf
        if not low <= kl_before <= self.target * (1 + self.band / 2):
            line.capture()  # the candidate is copied only when a move follows
            found = self._search(line.place, measure, points)
            if found is None:
                line.reject()
                scale, rejected, kept = 1.0, True, _finite(measure(full=True), "the step's starting weights")
            else:
                scale, kept = found, (kl_before if found == 1.0 else _finite(measure(full=True), f"scale {found:g}"))
        forwards = len(points) + (scale != 1.0 or rejected)
        if kept > ceiling:
            factor, kept, spent = pull_under_ceiling(line, measure, kept, ceiling=ceiling, aim=self.target,
                                                     power=self.power)
            scale, forwards = scale * factor, forwards + spent
        self.step(SequenceKL(kl_before, 1))  # finite: _finite read it
        return BudgetMove(kl_before, kept, scale, forwards, rejected)

    def _search(self, move: Callable[[float], None], measure: Measure, points: dict[float, float]) -> float | None:
        """The scale kept: the first measured within ``target * (1 +- band / 2)``; failing that, the
        largest measured under the band's top; None (reject) when no reading is under it."""
        near = self.target * self.band / 2
        lo, hi, last = 0.0, math.inf, 1.0  # KL(lo) <= target < KL(hi); KL(0) = 0
        reach = self.max_scale if self.push else 1.0
        while len(points) < self.max_forwards:
            kl = points[last]
            lo, hi = (lo, min(hi, last)) if kl > self.target else (max(lo, last), hi)
            guess = min(last * (self.target / kl) ** (1 / self.power) if kl > 0 else math.inf, reach)
            if not lo < guess < hi:
                guess = (lo + hi) / 2 if math.isfinite(hi) else reach
            if guess in points:
                break  # pushed to the reach and still under the target
            move(guess)
            points[guess] = _finite(measure(), f"scale {guess:g}")
            if points[guess] > 0 and kl > 0:
                self.power = fitted_power(last, kl, guess, points[guess])
            last = guess
            if abs(points[guess] - self.target) <= near:
                return guess
        under = [s for s, kl in points.items() if kl <= self.top]
        if not under:
            return None
        best = max(under, key=lambda s: (abs(points[s] - self.target) <= near, s))
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


def fitted_power(scale_a: float, kl_a: float, scale_b: float, kl_b: float) -> float:
    """The exponent of ``KL ~ s**power`` through two readings (positive KLs, distinct scales),
    held to [0.5, 4]: a flat pair reads 0.5, the most cautious model a next guess uses."""
    return min(max(math.log(kl_b / kl_a) / math.log(scale_b / scale_a), 0.5), 4.0)


def pull_under_ceiling(line: Line, measure: Measure, kl: float, *, ceiling: float, aim: float = math.inf,
                       power: float = 2.0) -> tuple[float, float, int]:
    """Pull the current weights (reading ``kl`` > ``ceiling``) back along their line to the
    reference until a reading over every answer is at most ``ceiling``.

    Each try aims at ``min(aim, CEILING_AIM * ceiling)`` with the model ``KL ~ s**power``, refitted
    on the last two readings after each, and no try takes the scale below half the last one (a
    power read too low must not throw the weights most of the way back). Returns ``(scale, kl,
    readings)``: the scale kept relative to the weights given, its KL, the readings spent. A KL
    that does not shrink along the line raises ``ValueError``."""
    goal, scale, seen = min(aim, CEILING_AIM * ceiling), 1.0, [kl]
    line.capture()
    for spent in range(1, CEILING_READINGS + 1):
        last, scale = scale, scale * max((goal / kl) ** (1 / power), 0.5)
        line.place(scale)
        kl = _finite(measure(full=True), f"scale {scale:g} under the ceiling")
        seen.append(kl)
        if kl <= ceiling:
            return scale, kl, spent
        power = fitted_power(last, seen[-2], scale, kl)
    raise ValueError(
        f"kl_bound: the KL did not fall under the ceiling {ceiling:g} along the line to the reference (readings "
        f"{[round(v, 4) for v in seen]} down to scale {scale:.3g}); the KL reading does not shrink toward the "
        "reference. Check that the reference is the model the policy started from.")


class ReferenceLine:
    """The trainable weights of ``policy`` on the line from ``reference`` through a candidate, and
    the step's start (weights and optimizer state) to reject an update.

    Copies: ``start`` takes the trainable weights and the optimizer's state (what a rejection
    restores); ``capture`` copies the weights on the line only when a move follows. ``release``
    drops both after the step. Points are computed in float32 at least (bf16 lerps lose moves)."""

    def __init__(self, policy: nn.Module, reference: nn.Module) -> None:
        if isinstance(reference, AdapterDisabledReference):
            self._pairs = _adapter_pairs(policy)
        else:
            self._pairs = [(param, anchor) for param, anchor in tracked_pairs(policy, reference).values()]
        self._captured: list[torch.Tensor] | None = None
        self._start: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] | None = None
        self._optimizer: torch.optim.Optimizer | None = None

    @torch.no_grad()
    def start(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy every parameter ``optimizer`` trains, and its state, before the step's update."""
        self._optimizer = optimizer
        self._start = [(p, p.detach().clone(), _copy_state(optimizer.state.get(p, {})))
                       for group in optimizer.param_groups for p in group["params"]]

    @property
    def weights(self) -> list[torch.Tensor]:
        """The trainable tensors on the line, in its order."""
        return [param for param, _ in self._pairs]

    @torch.no_grad()
    def capture(self) -> None:
        """Take the current weights as ``s = 1`` (a copy of each tensor on the line)."""
        self._captured = [param.detach().clone() for param, _ in self._pairs]

    @torch.no_grad()
    def place(self, scale: float) -> None:
        """Set the weights to ``theta_ref + scale * (captured - theta_ref)``."""
        if self._captured is None:
            raise RuntimeError("ReferenceLine.place: nothing captured; call capture() after the optimizer step first.")
        for (param, anchor), value in zip(self._pairs, self._captured):
            if scale == 1.0:
                param.copy_(value)
                continue
            wide = torch.promote_types(value.dtype, torch.float32)
            point = value.to(wide) * scale if anchor is None else torch.lerp(anchor.to(wide), value.to(wide), scale)
            param.copy_(point)

    @torch.no_grad()
    def reject(self) -> None:
        """Restore the weights and optimizer state ``start`` copied; they become the candidate."""
        if self._start is None or self._optimizer is None:
            raise RuntimeError("ReferenceLine.reject: no start was taken; call start(optimizer) before the update.")
        for param, weights, state in self._start:
            param.copy_(weights)
            if state:
                self._optimizer.state[param] = state
            else:  # the run's first step: the optimizer starts afresh, as if it had never stepped
                self._optimizer.state.pop(param, None)
        self._start = None  # handed over: a second reject has nothing to restore
        self.capture()

    def release(self) -> None:
        """Drop the copies (after the step)."""
        self._captured = self._start = self._optimizer = None


def _copy_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


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
