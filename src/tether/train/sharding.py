"""Where a run runs: its device and dtype, and the sharded learner's ranks (FSDP2, one process each).

``DTYPES`` maps a config name to the dtype the policy and reference weights are loaded in; every
reduction over the vocabulary runs in float32 whatever it is. ``DEVICES`` maps a config name to a
function returning the ``torch.device``: ``auto`` picks CUDA when a GPU is visible, ``cuda``
refuses to start without one instead of silently training on the CPU.

``tether train --nproc N`` runs N processes; each builds the same models from the same seed and
``shard_models`` shards the policy (and a separate reference) with FSDP2, one unit per decoder
layer plus the root. Rank r takes a contiguous block of the step's prompts with all their
answers (``Ranks.share``); losses divide by whole-batch denominators (``Ranks.total``) and
gradients are summed, so the run equals one process. ``SharedDraw`` draws every rank's tokens
with the very ``draw_categorical`` call one process makes. ``Ranks.unsharded()`` gathers the weights
once for the no-grad passes (``tether.train.recipe_sharded``), so no collective depends on data;
``tether.train.sharded_hold`` keeps them gathered through the leash's hold.
Rationale: docs/design.md.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tether._compat import forget_forward_order
from tether.models.records import HeadHidden
from tether.models.reference import AdapterDisabledReference
from tether.ops.checks import lookup, problems, whole_number
from tether.ops.logprobs import draw_categorical


# ------------------------------------------------------------------------------ device and dtype
# Only float32 and bfloat16 are offered for training: float16 needs loss scaling, which the recipe does
# not do. Log-softmax, entropy and exact KL run in float32 in ``tether.ops`` and the LoRA factors PEFT
# adds stay float32, so bfloat16 only changes the matrix products of the frozen base.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _auto() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _cpu() -> torch.device:
    return torch.device("cpu")


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise ValueError(
            f"device='cuda' but torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is "
            "False); use device=cpu, or device=auto to take a GPU only when there is one."
        )
    return torch.device("cuda")


DEVICES: dict[str, Callable[[], torch.device]] = {"auto": _auto, "cpu": _cpu, "cuda": _cuda}


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype of the config's ``dtype`` name."""
    return lookup(DTYPES, name, "dtype")


def resolve_device(name: str) -> torch.device:
    """The torch device of the config's ``device`` name (``cuda`` raises ``ValueError`` without a GPU)."""
    return lookup(DEVICES, name, "device")()


def load_generator_state(generator: torch.Generator, state: torch.Tensor, source: object) -> None:
    """Restore a sampling generator from ``source`` (a checkpoint); a state that another kind
    of generator wrote (CPU vs CUDA: the run moved machines, or ``device=auto`` resolves
    differently here) is a ``ValueError`` naming it, not a torch ``RuntimeError``."""
    try:
        generator.set_state(state)
    except RuntimeError as exc:
        raise ValueError(
            f"{source}: its sampling RNG state ({state.numel()} bytes) was not written by a {generator.device.type} "
            f"generator, so the run sampled on another kind of device than this one ({generator.device}); resume "
            "it where a device of the kind it trained on is available."
        ) from exc


# ------------------------------------------------------------------------------ ranks
T = TypeVar("T")
R = TypeVar("R")  # a dataclass of per-row tensors


@dataclass
class Ranks:
    """This process's place among the learner's ranks; with ``size`` 1 every method is an identity."""

    size: int = 1
    rank: int = 0
    device: torch.device = torch.device("cpu")  # where collectives run (NCCL needs CUDA tensors)
    units: list[tuple[nn.Module, bool]] = field(default_factory=list)  # FSDP units, reshard after forward?
    gathered: bool = field(default=False, repr=False)  # inside an ``unsharded()`` block

    @property
    def writer(self) -> bool:
        """Whether this rank writes the run directory (rank 0 only)."""
        return self.rank == 0

    def share(self, count: int) -> range:
        """This rank's block of ``count`` prompt indices (``count`` divides evenly, see ``config_problems``)."""
        per = count // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def total(self, value: Tensor) -> Tensor:
        """``value`` summed over ranks."""
        if self.size == 1:
            return value
        out = value.detach().to(self.device, copy=True)
        dist.all_reduce(out)
        return out.to(value.device)

    def parts(self, value: Tensor) -> list[Tensor]:
        """Every rank's ``value [n_r]`` or ``[n_r, T_r]``, in rank order; a second dimension comes back
        zero-padded on the right to the widest rank's."""
        if self.size == 1:
            return [value]
        wide = value.dim() == 2
        shape = torch.tensor([value.shape[0], value.shape[1] if wide else 0], device=self.device)
        shapes = [torch.zeros_like(shape) for _ in range(self.size)]
        dist.all_gather(shapes, shape)
        rows, width = (max(int(s[i]) for s in shapes) for i in (0, 1))
        sent = value.detach().to(self.device)
        sent = sent.to(torch.uint8) if sent.dtype == torch.bool else sent  # gloo has no bool collectives
        padded = sent.new_zeros((rows, width) if wide else (rows,))
        padded[tuple(slice(0, size) for size in sent.shape)] = sent
        got = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(got, padded)
        return [g[: int(s[0])].to(device=value.device, dtype=value.dtype) for g, s in zip(got, shapes)]

    def rows(self, value: Tensor) -> Tensor:
        """Every rank's rows of ``value`` stacked in rank order (see ``parts``)."""
        return value if self.size == 1 else torch.cat(self.parts(value))

    def all_rows(self, record: R) -> R:
        """A dataclass of per-row tensors (``[n_r]`` or ``[n_r, T_r]``, None, or a dict of them) with
        every rank's rows in rank order; a second dimension is zero-padded to the widest rank's."""
        if self.size == 1:
            return record

        def joined(value: Any) -> Any:
            if isinstance(value, dict):
                return {key: self.rows(v) for key, v in value.items()}
            return None if value is None else self.rows(value)

        return replace(record, **{f.name: joined(getattr(record, f.name)) for f in fields(record)})

    def on_writer(self, fn: Callable[[], T]) -> T | None:
        """``fn()`` on rank 0 alone (its result there, None on the other ranks). When it raises,
        rank 0 raises it and every other rank a ``RuntimeError`` naming it, instead of waiting
        in a collective that rank 0 will never join."""
        if self.size == 1:
            return fn()
        result, failure = None, None
        if self.writer:
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - told to the other ranks, then raised
                failure = exc
        told = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(told, src=0, device=self.device)
        if failure is not None:
            raise failure
        if told[0] is not None:
            raise RuntimeError(f"rank 0 failed, so rank {self.rank} stops too: {told[0]}")
        return result

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` (any picklable object) in rank order on rank 0; None on the others."""
        if self.size == 1:
            return [value]
        got: list[Any] | None = [None] * self.size if self.writer else None
        dist.gather_object(value, got, dst=0)
        return got

    def scatter(self, parts: list[Any] | None) -> Any:
        """Rank 0's ``parts[r]`` (any picklable object) on each rank ``r``; ``parts`` is read on rank 0 only."""
        if self.size == 1:
            return parts[0]
        got: list[Any] = [None]
        dist.scatter_object_list(got, parts if self.writer else None, src=0)
        return got[0]

    def own(self, kept: HeadHidden | None) -> HeadHidden | None:
        """``kept`` with its own copy of the head weight: the one it points at is a gathered FSDP
        parameter, whose storage ``unsharded()`` frees on leaving the block."""
        if self.size == 1 or kept is None:
            return kept
        bias = None if kept.bias is None else kept.bias.clone()
        return replace(kept, weight=kept.weight.clone(), bias=bias)

    @contextmanager
    def unsharded(self) -> Iterator[None]:
        """Every FSDP unit's full weights gathered for the block: its forwards need no collective.
        A block inside another gathers nothing and leaves them gathered for the outer one."""
        if self.gathered:
            yield
            return
        for unit, _ in self.units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        self.gathered = True
        try:
            yield
        finally:
            self.gathered = False
            for unit, after_forward in self.units:
                unit.reshard()
                unit.set_reshard_after_forward(after_forward, recurse=False)
                forget_forward_order(unit)  # the block's forwards may differ between ranks


class SharedDraw:
    """A ``tether.models.sampling.RowDraw`` over all ranks: draws as one process would on the whole batch."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    def tokens(self, probs: Tensor, generator: torch.Generator | None) -> Tensor:
        parts = self.ranks.parts(probs)
        drawn = draw_categorical(torch.cat(parts), generator)
        start = sum(part.shape[0] for part in parts[: self.ranks.rank])
        return drawn[start : start + probs.shape[0]]

    def all_ended(self, ended: Tensor) -> bool:
        live = self.ranks.total(torch.tensor([int((~ended).sum())], device=ended.device))
        return int(live) == 0


# ------------------------------------------------------------------------------ set-up
def config_problems(cfg: Any) -> list[str]:
    """What ``nproc`` cannot be combined with (``TrainConfig.validate`` lists these with the others)."""
    if bad := problems(whole_number, "nproc", cfg.nproc, low=1, fix="It counts the learner processes."):
        return bad
    if cfg.nproc == 1:
        return []
    n, p = cfg.nproc, []
    if cfg.prompts_per_step % n:
        p.append(f"prompts_per_step: {cfg.prompts_per_step} prompts cannot be split into whole groups over "
                 f"nproc={n} ranks; give a multiple of {n}")
    if cfg.updates_per_rollout != 1:
        p.append(f"updates_per_rollout: nproc={n} supports 1 update per rollout (its mini-batches would not "
                 f"be the one-process ones), got {cfg.updates_per_rollout}")
    if cfg.reference_update != "fixed":
        p.append(f"reference_update: nproc={n} supports the fixed reference only, got {cfg.reference_update!r}")
    return p


def join_ranks(cfg: Any) -> Ranks:
    """Join the process group that ``torch.distributed.run`` started (gloo on CPU, NCCL on CUDA).

    Refuses a world size other than ``cfg.nproc`` (``tether train --nproc N`` starts them).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.nproc:
        how = ("started under torch.distributed.run with WORLD_SIZE=" + str(world) if world > 1
               else "running as one process")
        raise ValueError(f"nproc: the config asks for {cfg.nproc} learner processes but this is {how}; launch "
                         f"with `tether train --nproc {cfg.nproc}` (or torchrun --nproc_per_node {cfg.nproc}), "
                         f"or set nproc={world}.")
    if world == 1:
        return Ranks()
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        atexit.register(_leave)
    return Ranks(size=world, rank=dist.get_rank(), device=device)


def leave_ranks() -> None:
    """End a finished run's process group on every rank together: a barrier, then the group is
    destroyed while the interpreter still runs. Left to ``atexit`` alone, a rank could tear its
    gloo threads down during interpreter shutdown and abort ("terminate called without an active
    exception") after a run that succeeded."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_writer() -> bool:
    """Whether this process writes files: one process, or rank 0 of a process group."""
    return not dist.is_initialized() or dist.get_rank() == 0


def shard_models(models: Any, ranks: Ranks) -> None:
    """Shard ``models.policy`` and a separate ``models.reference`` in place (see the module doc)."""
    if ranks.size == 1:
        return
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ranks.device.type, (ranks.size,))
    ranks.units.extend(_shard(models.policy, mesh))
    if not isinstance(models.reference, AdapterDisabledReference):
        ranks.units.extend(_shard(models.reference, mesh))


def _shard(model: nn.Module, mesh: Any) -> list[tuple[nn.Module, bool]]:
    """``fully_shard`` each decoder layer, then the Hugging Face model as root; returns the units."""
    from torch.distributed.fsdp import fully_shard

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"nproc: cannot shard {type(inner).__name__}: expected a Hugging Face causal LM whose "
                        "get_decoder() has a `layers` ModuleList (Llama, Qwen, Mistral, ...); use nproc=1.")
    units = [(fully_shard(layer, mesh=mesh), True) for layer in layers]
    # The root keeps its weights gathered after forward: the scorer reads the head weight afterwards.
    units.append((fully_shard(inner, mesh=mesh, reshard_after_forward=False), False))
    for unit, _ in units:
        unit.set_gradient_divide_factor(1.0)  # sum over ranks: the losses divide by full-batch counts
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum
    decoder.register_forward_pre_hook(_gather_root(inner))
    with torch.no_grad():  # the first forward through the root makes it FSDP's root
        inner(input_ids=torch.zeros(1, 1, dtype=torch.long, device=mesh.device_type))
    inner.reshard()
    return units


def _gather_root(root: nn.Module):
    def hook(*_: Any) -> None:
        root.unshard()  # a no-op while the root's weights are gathered

    return hook


def share_run(run: Any) -> None:
    """Point a built run's sampler at the shared draw and give its loss one forward per micro-batch."""
    ranks = run.ranks
    if ranks.size == 1:
        return
    if run.task.tool_use is None:  # a tool task's rollout runs on rank 0 alone (recipe_sharded.writer_rollout)
        run.sampler.generate_kwargs["draw"] = SharedDraw(ranks)
    run.actor.token_budget, run.actor.share_prefix = sys.maxsize, False


