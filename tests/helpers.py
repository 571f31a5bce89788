"""Test-only factories: re-exports of ``tether.models.tiny`` under short names.

Unit tests build a byte-level tokenizer and tiny random HF models in-process, so they need
no network and no model files.
"""

from __future__ import annotations

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
