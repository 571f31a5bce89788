"""Test-only factories: a byte-level tokenizer with chat templates and tiny random HF models.

Everything here is built in-process from the ``tokenizers`` library and random weights,
so unit tests need no network and no model files.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]

# ChatML exactly as the embedded SmolLM2 model renders it: no {% generation %} block.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The same rendering with {% generation %} markers around each assistant turn's content and
# its end-of-turn token, so transformers can return an assistant mask itself.
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


def make_tokenizer(
    chat_template: str | None = CHATML, *, pad_is_eos: bool = False
) -> PreTrainedTokenizerFast:
    """A reversible byte-level tokenizer: 256 byte tokens plus four special tokens.

    Ids: bytes 0-255 (in the ByteLevel alphabet order), then ``<|endoftext|>`` = 256,
    ``<|im_start|>`` = 257, ``<|im_end|>`` = 258 (eos), ``<pad>`` = 259.
    With ``pad_is_eos`` the pad token is ``<|im_end|>``, as in the embedded model.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in SPECIALS:
        vocab[tok] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>" if pad_is_eos else "<pad>",
    )
    tok.chat_template = chat_template
    return tok


def make_tiny_model(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    tie: bool = False,
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """A 2-layer random Llama whose vocabulary matches ``tokenizer`` (260 ids by default)."""
    tokenizer = tokenizer or make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    # Random init gives nearly uniform next-token distributions; scale the head so that
    # log-probs and KLs in tests are far from trivial.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model.eval()
