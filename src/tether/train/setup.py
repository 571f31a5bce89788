"""Model set-up for the recipe: policy (full or LoRA), reference, tokenizer, and the
reference's scoring wrapper (built the same way in-process and in a Ray reference service).

With LoRA the reference is the policy with its adapter disabled (no second copy of the
weights) unless the reference has to move (``sync``), which needs its own frozen copy of the
adapted model; full fine-tuning always takes a ``frozen_copy``.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    if cfg.lora_rank == 0:
        base.requires_grad_(True)
        reference = frozen_copy(base)
        movable = reference if cfg.reference_update != "fixed" else None
        return Models(base, reference, tokenizer, movable)
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
        return Models(policy, adapter_disabled(policy), tokenizer, None)
    reference = frozen_copy(policy)
    return Models(policy, reference, tokenizer, reference)


def reference_scorer(models: Models, cfg: TrainConfig) -> TransformersWrapper:
    """Scoring wrapper of ``models.reference``: log-probs under ``ref_log_probs`` at the sampling temperature."""
    return TransformersWrapper(models.reference, models.tokenizer, input_mode="tokens", generate=False,
                               temperature=cfg.temperature, log_probs_key="ref_log_probs")
