"""The one place tether reaches into dependency internals, and the version ranges it is tested on.

Everything here leans on something a dependency does not promise to keep: the layout of
``transformers``' ``DynamicCache`` (its ``layers`` with ``keys``/``values``, the
``ddp_cache_data`` constructor argument, ``batch_select_indices``), the attention kernel a
model's config names (read, and switched for a packed pass), the quantizer bookkeeping that
GGUF loading leaves on a model, the training-mode gate of transformers' gradient
checkpointing, FSDP2's record of the forward order, Ray's ``ENABLE_RAY_CLUSTER`` start-up flag
and its resolution of a bootstrap address, the ragged dim of torch's jagged nested tensors.
Keeping them together means a dependency upgrade is checked in one file, and ``TESTED``
(mirrored by the upper bounds in ``pyproject.toml``) says which releases that file was checked
against.
``version_problems()`` lists installed releases outside those ranges; importing tether warns
about them once, and the test suite fails on them with the same message.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import re
from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor

# Package -> (lowest tested release, first release not tested). Keep in step with pyproject.toml.
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.4", "2.15"),
    # 5.24 asks for peft>=0.22 in model.add_adapter, and no such peft is out yet.
    "transformers": ("4.56", "5.24"),
    "tensordict": ("0.9", "0.16"),
    "peft": ("0.10", "0.22"),
    "ray": ("2.9", "2.61"),
}


def _release(text: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``: the numeric release, local and pre-release tags dropped."""
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0].split("rc")[0])[:3])


def installed_versions() -> dict[str, str]:
    """Installed release of every package in ``TESTED`` (optional extras may be absent)."""
    found = {}
    for name in TESTED:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def version_problems(versions: Mapping[str, str] | None = None) -> list[str]:
    """One sentence per package whose release lies outside its tested range.

    Args:
        versions: package -> release string; the installed ones when ``None``.
    """
    problems = []
    for name, version in (installed_versions() if versions is None else versions).items():
        low, high = TESTED[name]
        if not _release(low) <= _release(version) < _release(high):
            problems.append(
                f"{name} {version} is outside the range tether is tested with (>={low},<{high}); "
                f"install a release in that range (pip install '{name}>={low},<{high}') or expect "
                "breakage in tether._compat, which holds every use of its internals."
            )
    return problems


# ------------------------------------------------------------------ transformers KV caches
def new_cache(layers: list[tuple[Tensor, Tensor]] | None = None) -> Any:
    """A ``DynamicCache``, empty or holding the given per-layer ``(keys, values)``.

    ``keys``/``values`` are ``[B, heads, S, head_dim]`` as the decoder's attention stores them.
    """
    from transformers import DynamicCache

    if layers is None:
        return DynamicCache()
    return DynamicCache(ddp_cache_data=layers)


def cache_layers(cache: Any) -> list[tuple[Tensor, Tensor]] | None:
    """Per-layer ``(keys, values)`` of a plain full-attention ``DynamicCache``.

    ``None`` when any layer is of another kind (sliding-window, hybrid, quantised): those
    cannot be copied row-wise onto other sequences, so callers fall back to plain scoring.
    """
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers or not all(type(layer) is DynamicLayer for layer in layers):
        return None
    return [(layer.keys, layer.values) for layer in layers]


def select_cache_rows(cache: Any, index: Tensor) -> None:
    """Keep (and repeat or reorder) the cache's batch rows ``index`` in place."""
    cache.batch_select_indices(index)


# ------------------------------------------------------------------ torch nested tensors
def jagged_ragged_dim(x: Tensor) -> int:
    """The dim along which a jagged nested tensor's rows differ; torch keeps it only privately."""
    return int(getattr(x, "_ragged_idx", 1))


# ------------------------------------------------------------------ transformers attention kernels
def attention_implementation(model: Any) -> str | None:
    """The attention kernel a Hugging Face model's config selected (``"sdpa"``, ``"flash_attention_2"``, ...)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def supports_attention_interface(model: Any) -> bool:
    """Whether ``model``'s attention layers call the kernel its config names through transformers'
    ``AttentionInterface`` (so a kernel registered there replaces theirs)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(inner, "_supports_attention_backend", False))


def register_attention(name: str, fn: Any) -> None:
    """Register ``fn`` under ``name`` in transformers' attention interface. The name gets no mask
    function: transformers then builds no attention mask for it, and ``fn`` reads the layout
    from its keyword arguments."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)


@contextlib.contextmanager
def attention_kernel(model: Any, name: str | None) -> Iterator[None]:
    """Let ``model`` (and every module sharing its config) attend with kernel ``name`` inside the block."""
    config = getattr(model, "config", None)
    before = attention_implementation(model)
    if name is None or config is None or name == before:
        yield
        return
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


# ------------------------------------------------------------------ transformers GGUF loading
def clear_quantizer_marker(model: Any) -> None:
    """Remove the GGUF quantizer bookkeeping from a model whose weights are dense.

    ``save_pretrained`` refuses a model that still carries ``hf_quantizer``; the caller must
    have checked that every weight really is a plain floating-point tensor.
    """
    for attribute in ("hf_quantizer", "quantization_method"):
        if attribute in vars(model):
            delattr(model, attribute)
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


# ------------------------------------------------------------------ adapters
def has_integrated_adapter(model: Any) -> bool:
    """Whether an adapter was attached through transformers' own PEFT integration (``add_adapter``)."""
    return bool(getattr(model, "_hf_peft_config_loaded", False))


def has_tuner_layers(model: Any) -> bool:
    """Whether any submodule is a PEFT tuner layer (LoRA and relatives); False without PEFT."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    return any(isinstance(module, BaseTunerLayer) for module in model.modules())


# ------------------------------------------------------------------ gradient checkpointing
def enable_gradient_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing of every decoder layer, active only under grad mode.

    transformers checkpoints a layer only while the layer is in training mode, and drops the
    KV cache when it does. tether keeps every model in eval mode (dropout off), so a forward
    pre-hook sets the checkpointed layers' own ``training`` flag (not their children's, so
    attention dropout stays off) to ``torch.is_grad_enabled()`` before the decoder stack runs
    (a hook on each layer would come too late where ``__call__`` itself checkpoints, as in
    transformers 4): the loss's forward is
    checkpointed, sampling and scoring under ``no_grad`` keep their cache. The method is
    ``activation_checkpointing_enable`` from transformers 5, ``gradient_checkpointing_enable``
    before; the hook reads the layers at call time, so a deep copy of the model stays separate.
    """
    import torch

    if getattr(model, "activation_checkpointing_enable", None) is not None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not checkpointed_layers(model):
        raise ValueError(f"gradient_checkpointing: {type(model).__name__} has no checkpointable layers; "
                         "turn gradient_checkpointing off for this model.")

    def follow_grad_mode(module: Any, args: Any) -> None:
        for layer in checkpointed_layers(module):
            layer.training = torch.is_grad_enabled()

    # On the decoder stack: generation enters through the model, tether's scoring through the
    # decoder itself (see tether.models.scoring), and both reach the layers from there.
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    decoder.register_forward_pre_hook(follow_grad_mode)


def checkpointed_layers(model: Any) -> list[Any]:
    """The decoder layers of ``model`` whose activations transformers would checkpoint."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


# ------------------------------------------------------------------ torch FSDP2
def forget_forward_order(unit: Any) -> None:
    """Drop the forward order FSDP2 keeps on ``unit`` (a ``fully_shard`` module) for its implicit
    backward prefetch. FSDP2 records every forward, no-grad ones included, and clears the record
    only after a backward; forwards that ran on some ranks only (rank 0's rollout for every rank)
    would leave the ranks prefetching different units in the next backward, each waiting on a
    collective the other never joins."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # releases before the per-module list kept one group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    for group in groups:
        group.comm_ctx.post_forward_order.clear()
        group._post_forward_indices.clear()


# ------------------------------------------------------------------ Ray start-up
@contextlib.contextmanager
def ray_cluster_mode_off() -> Iterator[None]:
    """Clear Ray's ``ENABLE_RAY_CLUSTER`` flag while a local cluster starts.

    With the flag on (the Linux default) Ray takes the machine's routable address as the
    node address even when asked for 127.0.0.1. It is a module constant read at import, so
    it is patched for the duration of the call; ``create=True`` lets a release without the
    flag start, and ``start_local_cluster`` then checks the addresses it actually bound.
    """
    from unittest import mock

    from ray._private import ray_constants

    with mock.patch.object(ray_constants, "ENABLE_RAY_CLUSTER", False, create=True):
        yield


def ray_dial_address(address: str) -> str | None:
    """The ``host:port`` that ``ray.init(address=address)`` connects to (None: it would start a cluster).

    Ray resolves ``"auto"`` to the cluster recorded on this machine and replaces a loopback
    host by the machine's routable address; tether probes that address before connecting,
    because ``ray.init`` retries an address with nothing behind it for ever.
    """
    from ray._private import services

    return services.canonicalize_bootstrap_address(address)


def peft_model(base: Any, config: Any) -> Any:
    """``peft.get_peft_model(base, config)`` without the ``FutureWarning`` transformers >= 5 raises
    when PEFT reads the deprecated ``is_gradient_checkpointing`` (PEFT's call, nothing a user can
    change; it printed on every LoRA run)."""
    import warnings

    import peft

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)
        return peft.get_peft_model(base, config)


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says a write ran out of space: ``OSError`` ENOSPC/EDQUOT, or the
    ``SafetensorError`` safetensors raises with the OS error in its text (it wraps Rust's I/O error)."""
    import errno

    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(exc)
    return type(exc).__name__ == "SafetensorError" and ("No space left" in text or "StorageFull" in text
                                                        or "Disk quota" in text)
