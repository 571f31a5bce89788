"""Model set-up for the recipe: policy (full or LoRA), reference, tokenizer, and the
reference's scoring wrapper (built the same way in-process and in a Ray reference service).

With LoRA the reference is the policy with its adapter disabled (no second copy of the
weights) unless the reference has to move (``sync``), which needs its own frozen copy of the
adapted model; full fine-tuning, and a run continuing a saved adapter (``cfg.adapter``), always
take a ``frozen_copy``. Where the base comes from, and the adapter, is ``model_source``'s job;
``cfg.dtype`` and ``cfg.device`` resolve through the ``sharding`` registries.

``Models.fingerprint`` identifies the base weights and tokenizer as loaded, before any
adapter or update, so a checkpoint can refuse to be loaded onto another base of the same
shapes. It hashes every tensor's name, shape, dtype and an evenly strided sample of at most
``_SAMPLE`` of its values (all of them for small tensors): two bases that differ at all
differ in far more places than that sample misses, and hashing 135M weights in full would
add seconds to every start. A continued adapter adds the digest of its weights as loaded.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tether._compat import enable_gradient_checkpointing
from tether.models import TransformersWrapper, adapter_disabled, frozen_copy
from tether.train.config import TrainConfig
from tether.train.model_source import adapter_digest, load_adapter, load_base
from tether.train.sharding import resolve_device, resolve_dtype


class AdapterNote(UserWarning):
    """A continued adapter's own rank, alpha and targets replace lora_rank, lora_alpha and lora_targets."""


@dataclass
class Models:
    policy: nn.Module
    reference: nn.Module
    tokenizer: Any
    # The reference's own weights, when it is a separate copy that an update policy moves.
    movable_reference: nn.Module | None
    fingerprint: dict[str, str] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")  # where the policy's weights live


_SAMPLE = 1 << 16
_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(model: nn.Module, tokenizer: Any) -> dict[str, str]:
    """SHA-256 digests of the base weights (strided sample) and of the tokenizer's vocabulary."""
    weights = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        # Raw bits as integers of the same width (numpy has no bfloat16); numpy's strided
        # copy is far faster than torch's here.
        bits = tensor.detach().cpu().reshape(-1).view(_SAME_WIDTH[tensor.element_size()]).numpy()
        weights.update(f"{name}:{list(tensor.shape)}:{tensor.dtype};".encode())
        weights.update(bits[:: max(1, bits.size // _SAMPLE)].tobytes())
    vocab = {"vocab": sorted(tokenizer.get_vocab().items()), "special": str(tokenizer.special_tokens_map),
             "chat_template": str(getattr(tokenizer, "chat_template", None))}
    text = json.dumps(vocab, sort_keys=True).encode()
    return {"weights": weights.hexdigest(), "tokenizer": hashlib.sha256(text).hexdigest()}


def build_models(cfg: TrainConfig) -> Models:
    """Policy, reference and tokenizer for ``cfg``: base from ``cfg.model`` in ``cfg.dtype`` on
    ``cfg.device``, then a new LoRA adapter, the one in ``cfg.adapter``, or full fine-tuning."""
    device = resolve_device(cfg.device)  # first: a refused device costs no model load
    base, tokenizer = load_base(cfg.model, cfg.seed, resolve_dtype(cfg.dtype))
    base.eval()  # RL needs sampling and scoring to agree: no dropout anywhere
    prints = fingerprint(base, tokenizer)
    base.to(device)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(base)
    if cfg.adapter:
        return _continued_adapter(base, tokenizer, cfg, prints, device)
    if cfg.lora_rank == 0:
        base.requires_grad_(True)
        reference = frozen_copy(base)
        movable = reference if cfg.reference_update != "fixed" else None
        return Models(base, reference, tokenizer, movable, prints, device)
    import peft

    torch.manual_seed(cfg.seed)
    lora = peft.LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=0.0,
        target_modules=[t.strip() for t in cfg.lora_targets.split(",") if t.strip()],
    )
    policy = peft.get_peft_model(base, lora).eval()
    if cfg.reference_update == "fixed":
        return Models(policy, adapter_disabled(policy), tokenizer, None, prints, device)
    reference = frozen_copy(policy)
    return Models(policy, reference, tokenizer, reference, prints, device)


def _continued_adapter(base: nn.Module, tokenizer: Any, cfg: TrainConfig, prints: dict[str, str],
                       device: torch.device) -> Models:
    """The policy continues the saved adapter; the reference is that policy as loaded, frozen.

    Not the base with the adapter disabled: the leash holds the policy near where this run
    starts, and pulling it back to the base would undo the adapter's earlier training. The
    frozen copy costs one more copy of the weights.
    """
    if cfg.lora_rank == 0:
        raise ValueError(f"adapter: {cfg.adapter!r} trains a LoRA adapter, but lora_rank=0 asks to train every "
                         "weight; drop adapter, or leave lora_rank at a positive value.")
    policy = load_adapter(base, cfg.adapter).eval()
    lora = policy.peft_config["default"]
    warnings.warn(f"adapter {cfg.adapter}: continuing its LoRA (rank {lora.r}, alpha {lora.lora_alpha}, targets "
                  f"{sorted(lora.target_modules)}); lora_rank, lora_alpha and lora_targets are not used.",
                  AdapterNote, stacklevel=2)
    prints = {**prints, "adapter": adapter_digest(policy)}
    reference = frozen_copy(policy)
    movable = reference if cfg.reference_update != "fixed" else None
    return Models(policy, reference, tokenizer, movable, prints, device)


def reference_scorer(models: Models, cfg: TrainConfig) -> TransformersWrapper:
    """Scoring wrapper of ``models.reference``: log-probs under ``ref_log_probs`` at the sampling temperature."""
    return TransformersWrapper(models.reference, models.tokenizer, input_mode="tokens", generate=False,
                               temperature=cfg.temperature, log_probs_key="ref_log_probs")
