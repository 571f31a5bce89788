"""Test-only factories: re-exports of ``tether.models.tiny`` under short names.

Unit tests build a byte-level tokenizer and tiny random HF models in-process, so they need
no network and no model files.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from tether.models.tiny import CHATML, CHATML_GENERATION, SPECIAL_TOKENS, byte_tokenizer, tiny_causal_lm

SPECIALS = list(SPECIAL_TOKENS)
__all__ = ["CHATML", "CHATML_GENERATION", "SPECIALS", "make_tiny_model", "make_tokenizer"]


def make_tokenizer(chat_template: str | None = CHATML, *, pad_is_eos: bool = False) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: eos ``<|im_end|>`` = 258, pad ``<pad>`` = 259 (or eos)."""
    return byte_tokenizer(chat_template, pad_is_eos=pad_is_eos)


def make_tiny_model(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    tie: bool = False,
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """A 2-layer random Llama over ``tokenizer``'s vocabulary (260 ids by default)."""
    return tiny_causal_lm(tokenizer or make_tokenizer(), hidden=hidden, layers=layers, seed=seed, tie=tie, dtype=dtype)


def make_tiny_classifier(
    *, pad_token_id: int | None = None, eos_token_id: int | None = None, num_labels: int = 1,
    seed: int = 0, max_positions: int = 256, dtype: torch.dtype = torch.float32,
):
    """A 2-layer random ``LlamaForSequenceClassification`` over the 260-id test vocabulary.

    Seeded without disturbing the global RNG, like ``make_tiny_model``.
    """
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        num_labels=num_labels, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return LlamaForSequenceClassification(config).to(dtype).eval()
    finally:
        torch.random.set_rng_state(state)


def unloadable_model(directory: Path) -> str:
    """A model directory that passes the config's checks but fails to load (an unknown
    architecture, no tokenizer): a run that loads its models before a check names the model's
    error instead of the check's, so a test sees the order through the public ``model`` field."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"model_type": "no-such-architecture"}')
    return str(directory)
