"""Where and in which precision ``tether train`` runs: the ``dtype`` and ``device`` registries.

``DTYPES`` maps a config name to the dtype the policy and reference weights are loaded in.
Only float32 and bfloat16 are offered: float16 training needs loss scaling, which the recipe
does not do. Whatever the weights' dtype, every reduction over the vocabulary (log-softmax,
entropy, exact KL) runs in float32 in ``tether.ops``, and the LoRA factors PEFT adds stay
float32, so bfloat16 only changes the matrix products of the frozen base.

``DEVICES`` maps a config name to a function returning the ``torch.device``: ``auto`` picks
CUDA when a GPU is visible, ``cuda`` refuses to start without one instead of silently
training on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tether.ops.registry import lookup

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
