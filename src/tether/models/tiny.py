"""A tiny random causal LM and a reversible byte-level chat tokenizer, built in-process.

Used by ``tether train --model tiny`` for smoke runs in seconds and by the unit tests. Both
are made from scratch (``tokenizers`` + random weights): nothing is downloaded or read.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>")

# ChatML as the embedded SmolLM2 model renders it (no {% generation %} block).
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The same rendering with {% generation %} around each assistant turn's content and its
# end-of-turn token, so that transformers can return the assistant mask itself.
CHATML_GENERATION = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer(chat_template: str | None = CHATML, *, pad_is_eos: bool = False) -> PreTrainedTokenizerFast:
    """A reversible byte-level tokenizer: 256 byte tokens plus four special tokens.

    Ids 0-255 are the bytes (in the ByteLevel alphabet's sorted order), then
    ``<|endoftext|>`` = 256, ``<|im_start|>`` = 257, ``<|im_end|>`` = 258 (eos) and
    ``<pad>`` = 259. With ``pad_is_eos`` the pad token is ``<|im_end|>``, as in SmolLM2.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>" if pad_is_eos else "<pad>",
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_causal_lm(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    tie: bool = False,
    dtype: torch.dtype = torch.float32,
    head_scale: float = 20.0,
) -> LlamaForCausalLM:
    """A random Llama (``layers`` layers, width ``hidden``) over ``tokenizer``'s vocabulary.

    ``head_scale`` multiplies the output head at init: a plain random init gives nearly
    uniform next-token distributions, which make log-prob and KL checks trivial.
    """
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config).to(dtype)
    finally:
        torch.random.set_rng_state(generator_state)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model.eval()
