"""The leash's hold over sharded weights: the line search's points placed on weights gathered once.

``gathered_line(run)`` is ``run.line`` in one process and a ``GatheredLine`` over several ranks:
every FSDP unit stays gathered from the hold's start to its end, so the budget's readings run no
collective, and the point kept is written to each rank's shards once (``shard_like``, which the
checkpoint loader uses too). Rationale and measurements: docs/design.md, docs/scaling.md.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from tether.control.budget import ReferenceLine
from tether.train.sharding import Ranks

__all__ = ["GatheredLine", "gathered_line", "shard_like"]


class GatheredLine:
    """The run's ``ReferenceLine`` of sharded weights, held with every unit gathered once, from
    construction to ``release``: the line search's points are placed on the gathered weights only
    (a second ``ReferenceLine`` over them), so its readings gather nothing, and the point kept is
    written to each rank's shards once, at ``release``. A rejection restores the shards (the
    sharded line's ``start``), then gathers afresh. Costs a gathered copy of the candidate's
    trainable weights while a move is searched."""

    def __init__(self, line: Any, ranks: Ranks, policy: nn.Module, reference: nn.Module) -> None:
        self.line, self.ranks, self.policy, self.reference = line, ranks, policy, reference
        self._block = ExitStack()
        self._placed = 1.0  # the gathered weights' scale; at 1 they are the shards' candidate
        self._gather()

    def _gather(self) -> None:
        self._block.enter_context(self.ranks.unsharded())
        # While gathered, the modules' parameters are the full tensors, under the shards' names.
        self.gathered_line = ReferenceLine(self.policy, self.reference)

    def capture(self) -> None:
        self.gathered_line.capture()

    def place(self, scale: float) -> None:
        self.gathered_line.place(scale)
        self._placed = scale

    def reject(self) -> None:
        self.line.reject()  # the shards and optimizer state are the step's start again
        self._block.close()
        self._gather()
        self.gathered_line.capture()
        self._placed = 1.0

    @torch.no_grad()
    def _write_shards(self) -> None:
        for shard, whole in zip(self.line.weights, self.gathered_line.weights, strict=True):
            if shard.shape != whole.shape:
                raise RuntimeError(f"GatheredLine: a sharded weight of shape {tuple(shard.shape)} met a gathered one "
                                   f"of shape {tuple(whole.shape)}; the two lines must list the same parameters")
            shard.copy_(shard_like(whole, shard))

    def release(self) -> None:
        try:
            if self._placed != 1.0:
                self._write_shards()
        finally:  # the units are resharded even when the write-back fails
            self.line.release()
            self._block.close()


def shard_like(value: Tensor, param: Tensor) -> Tensor:
    """A whole tensor laid out as ``param``: this rank's shard of it when ``param`` is sharded. No
    collective: every rank holds ``value`` and keeps its own part."""
    if not isinstance(param, DTensor):
        return value
    value = value.to(dtype=param.dtype, device=param.device_mesh.device_type)
    return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)


def gathered_line(run: Any) -> Any:
    """``run.line`` for a hold: as it is in one process, a ``GatheredLine`` over several ranks."""
    if run.ranks.size == 1:
        return run.line
    return GatheredLine(run.line, run.ranks, run.models.policy, run.models.reference)
