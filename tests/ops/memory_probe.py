"""Deterministic memory probes for the chunked vocabulary reductions.

Wall-clock memory (RSS) is noisy and allocator dependent, so the tests instead watch every
ATen call: :class:`AllocationRecorder` is a ``TorchDispatchMode`` that records each tensor
an op returns whose storage did not come in as an argument, i.e. every fresh allocation,
with its element count and dtype. Views and ``out=`` writes share an argument's storage
and are not counted; that is exactly what makes a reused chunk buffer cheap.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class Allocation:
    op: str
    numel: int
    dtype: torch.dtype


@dataclass
class AllocationRecorder(TorchDispatchMode):
    """Records fresh allocations and op counts while active (``with AllocationRecorder() as r``)."""

    allocations: list[Allocation] = field(default_factory=list)
    op_counts: Counter = field(default_factory=Counter)

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.op_counts[name] += 1
        seen = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                numel = t.untyped_storage().nbytes() // t.element_size()
                self.allocations.append(Allocation(name, numel, t.dtype))
        return out

    def largest(self, dtype: torch.dtype | None = None) -> int:
        sizes = [a.numel for a in self.allocations if dtype is None or a.dtype == dtype]
        return max(sizes, default=0)


def saved_tensor_sizes(fn) -> list[int]:
    """Element counts of every tensor autograd saves for backward while running ``fn()``."""
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return sizes, result
