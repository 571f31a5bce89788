"""How a run finishes: a running average of the kept weights, and an interpolation chosen at the end.

``weight_average`` (Polyak/EMA averaging, WARP's lever): after every step's leash the trainable
weights kept update ``avg <- mu avg + (1 - mu) kept`` (``avg`` starts at the initial weights);
after the last step the average replaces them and, with a leash on the weights (the budget or
``kl_bound``), is read on the last step's answers and pulled back along the line to the reference
when over the band's upper edge or the ceiling (``pull_under_ceiling``). ``final_kl_target``
(WiSE-FT, WARP's LITI): the final weights become ``theta_0 + lambda (theta_T - theta_0)``, lambda
found by the budget's own line search (a ``BudgetKLController`` whose band ends at the target,
the target its ceiling) so the KL per answer on the last step's answers lands at or under it.

Departures from WARP: one policy, not M averaged runs; the EMA is the run's output, not an anchor
its KL is measured to (the leash stays to the fixed reference); the interpolation is aimed at a
KL, not swept over lambda by hand; with LoRA the factors are averaged (an average of products is
not a product of averages: docs/leash.md) and the line scales ``lora_B``, so ``lambda``
interpolates the adapted weights. Why and what it costs: docs/leash.md, "Finishing a run".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from tether.control.budget import BudgetKLController, BudgetMove, ReferenceLine, pull_under_ceiling
from tether.models.records import StepRecord
from tether.train.updates import KLReadings, TrackedLine

__all__ = ["FINISH_KEYS", "WeightAverage", "config_problems", "finish_step", "land_on_target", "weight_average"]

# The last step's record entries a finish writes; the summary copies them.
FINISH_KEYS = ("weight_average_kl_per_seq", "weight_average_scale", "final_interpolation", "final_kl_per_seq")
# final_kl_target's search: a band LAND_BAND wide whose upper edge (where a move starts) is the target
# (the search keeps the first reading in [0.951, 1] x target), in at most LAND_READINGS readings.
LAND_BAND = 0.05
LAND_READINGS = 8


class WeightAverage:
    """The exponential average (decay ``mu``) of ``policy``'s trainable weights, float32 at least
    (a bf16 average would drop the ``1 - mu`` share of small moves); starts at the weights given."""

    def __init__(self, policy: nn.Module, mu: float) -> None:
        self.mu = mu
        self.params = {name: p for name, p in policy.named_parameters() if p.requires_grad}
        self.average = {name: p.detach().to(torch.promote_types(p.dtype, torch.float32)).clone()
                        for name, p in self.params.items()}

    @torch.no_grad()
    def observe(self) -> None:
        """``avg <- mu avg + (1 - mu) theta`` with the current weights."""
        for name, param in self.params.items():
            self.average[name].mul_(self.mu).add_(param.detach().to(self.average[name].dtype), alpha=1 - self.mu)

    @torch.no_grad()
    def apply(self) -> None:
        """The policy's trainable weights become the average."""
        for name, param in self.params.items():
            param.copy_(self.average[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.average

    def load(self, path: Path) -> None:
        """The average a checkpoint saved (``average.safetensors``); it must fit this policy."""
        saved = load_file(str(path))
        if set(saved) != set(self.average) or any(saved[n].shape != self.average[n].shape for n in saved):
            raise ValueError(f"{path}: the saved average does not fit this run's trainable weights (names or shapes "
                             "differ); was lora_rank, lora_targets or the model changed since the run started?")
        for name, value in saved.items():
            self.average[name].copy_(value)


def weight_average(cfg: Any, policy: nn.Module) -> WeightAverage | None:
    """The average for ``cfg.weight_average`` (None when 0), built before any checkpoint is loaded."""
    return WeightAverage(policy, cfg.weight_average) if cfg.weight_average else None


@torch.no_grad()
def finish_step(run: Any, record: StepRecord, step: int) -> dict[str, Any]:
    """After step ``step``'s leash: the average takes the kept weights; after the last step the
    finishes apply (the average, then its leash or the interpolation) and their entries return."""
    if run.average is not None:
        run.average.observe()
    if step + 1 < run.cfg.steps or (run.average is None and not run.cfg.final_kl_target):
        return {}
    if run.average is not None:
        run.average.apply()
    if run.cfg.final_kl_target:  # after the average too: the landing holds the averaged weights itself
        line = run.line or ReferenceLine(run.models.policy, run.models.reference)
        move = land_on_target(run, record, line, run.cfg.final_kl_target)
        return {"final_interpolation": move.scale, "final_kl_per_seq": move.kl_kept}
    if run.line is None:  # no leash on the weights: the average is kept as it is, unread
        return {}
    kl, scale = _hold_average(run, record, run.line)
    return {"weight_average_kl_per_seq": kl, "weight_average_scale": scale}


def _hold_average(run: Any, record: StepRecord, line: Any) -> tuple[float, float]:
    """The averaged weights' KL per answer on ``record`` and the scale kept: over the budget's
    band's upper edge (``kl_target (1 + kl_band / 2)``, where its search starts) or ``kl_bound``, they are
    pulled back along the line to the reference toward the target, as a step's kept weights are."""
    cfg, ceiling = run.cfg, run.cfg.kl_bound or math.inf
    if cfg.kl_controller == "budget":
        ceiling = min(ceiling, cfg.kl_target * (1 + cfg.kl_band / 2))
    readings = KLReadings(run, record, confirm_every=1)
    kl, scale = readings(full=True), 1.0
    try:
        if kl > ceiling:
            scale, kl, _ = pull_under_ceiling(TrackedLine(line, readings), readings, kl, ceiling=ceiling,
                                              aim=cfg.kl_target)
    finally:
        line.release()
    return kl, scale


def land_on_target(run: Any, record: StepRecord, line: Any, target: float) -> BudgetMove:
    """The current weights moved to ``theta_0 + lambda (theta - theta_0)`` on ``line``, ``lambda``
    in [0, 1] found by the budget's search so that the mean KL per answer on ``record`` is at most
    ``target`` (1 when already under it); the move's ``scale`` is lambda, ``kl_kept`` the KL."""
    search = BudgetKLController(kl_coef=1.0, kl_target=target / (1 + LAND_BAND / 2), band=LAND_BAND,
                                max_forwards=LAND_READINGS)
    readings = KLReadings(run, record, confirm_every=1)
    line.start(run.optimizer)  # a search with nothing under its top returns here, then the ceiling pulls
    try:
        return search.hold(TrackedLine(line, readings), readings, ceiling=target)
    finally:
        line.release()


def config_problems(cfg: Any) -> list[str]:
    """The finishes' combinations (ranges are ``TrainConfig``'s): one process, a fixed reference
    (the line and the average are to the weights the run started from), a target under the ceiling."""
    on = [f"{name}={getattr(cfg, name):g}" for name in ("weight_average", "final_kl_target") if getattr(cfg, name)]
    if not on:
        return []
    p, what = [], " and ".join(on)
    if cfg.nproc > 1:
        p.append(f"{what}: the average and the final line search run in one process (nproc=1), got nproc={cfg.nproc}; "
                 "set nproc=1 or turn them off (0)")
    if cfg.reference_moves:
        p.append(f"{what}: the finish is held to the reference the run started from, but reference_update="
                 f"{cfg.reference_update!r} / reference_move={cfg.reference_move!r} move it; set reference_update=fixed "
                 "and reference_move=off, or turn them off (0)")
    if cfg.final_kl_target and cfg.kl_bound and cfg.final_kl_target > cfg.kl_bound:
        p.append(f"final_kl_target: {cfg.final_kl_target:g} is above kl_bound={cfg.kl_bound:g}, so the final weights "
                 f"would land over the ceiling; lower final_kl_target to at most {cfg.kl_bound:g} or raise kl_bound")
    return p
