"""Model set-up for the recipe: policy (full or LoRA), reference, tokenizer, and the
reference's scoring wrapper (built the same way in-process and in a Ray reference service).

With LoRA the reference is the policy with its adapter disabled (no second copy of the
weights) unless the reference has to move (``sync``), which needs its own frozen copy of the
adapted model; full fine-tuning always takes a ``frozen_copy``.

``Models.fingerprint`` identifies the base weights and tokenizer as loaded, before any
adapter or update, so a checkpoint can refuse to be loaded onto another base of the same
shapes. It hashes every tensor's name, shape, dtype and an evenly strided sample of at most
``_SAMPLE`` of its values (all of them for small tensors): two bases that differ at all
differ in far more places than that sample misses, and hashing 135M weights in full would
add seconds to every start.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tether.models import TransformersWrapper, adapter_disabled, frozen_copy, load_default_model
from tether.models.tiny import byte_tokenizer, tiny_causal_lm
from tether.train.config import TrainConfig


@dataclass
class Models:
    policy: nn.Module
    reference: nn.Module
    tokenizer: Any
    # The reference's own weights, when it is a separate copy that an update policy moves.
    movable_reference: nn.Module | None
    fingerprint: dict[str, str] = field(default_factory=dict)


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


def load_base(spec: str, seed: int) -> tuple[nn.Module, Any]:
    """``default`` (embedded SmolLM2), ``tiny`` (random 2-layer model) or a local HF directory."""
    if spec == "default":
        return load_default_model()
    if spec == "tiny":
        tokenizer = byte_tokenizer()
        return tiny_causal_lm(tokenizer, hidden=64, layers=2, seed=seed, head_scale=1.0), tokenizer
    path = Path(spec)
    if not path.is_dir():
        raise ValueError(
            f"model: expected 'default', 'tiny' or a local model directory, got {spec!r} "
            "(no such directory; nothing is downloaded)."
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, torch_dtype=torch.float32)
    return model.eval(), tokenizer


def build_models(cfg: TrainConfig) -> Models:
    base, tokenizer = load_base(cfg.model, cfg.seed)
    base.eval()  # RL needs sampling and scoring to agree: no dropout anywhere
    prints = fingerprint(base, tokenizer)
    if cfg.lora_rank == 0:
        base.requires_grad_(True)
        reference = frozen_copy(base)
        movable = reference if cfg.reference_update != "fixed" else None
        return Models(base, reference, tokenizer, movable, prints)
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
        return Models(policy, adapter_disabled(policy), tokenizer, None, prints)
    reference = frozen_copy(policy)
    return Models(policy, reference, tokenizer, reference, prints)


def reference_scorer(models: Models, cfg: TrainConfig) -> TransformersWrapper:
    """Scoring wrapper of ``models.reference``: log-probs under ``ref_log_probs`` at the sampling temperature."""
    return TransformersWrapper(models.reference, models.tokenizer, input_mode="tokens", generate=False,
                               temperature=cfg.temperature, log_probs_key="ref_log_probs")
