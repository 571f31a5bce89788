"""TransformersWrapper in tokens mode reads prompt masks where TorchRL stores them."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tests.helpers import make_tiny_model, make_tokenizer
from tether.models import TransformersWrapper


def test_tokens_mode_prompt_mask_under_all_attention_mask():
    """TorchRL keeps the mask of tokens-mode prompts under ("masks", "all_attention_mask").
    Prompts of 3 and 6 tokens left-padded to 6: the prompts count 3 and 6 tokens (the padding
    is not read as prompt), and generation equals the one given the same mask under
    ("masks", "prompt_attention_mask")."""
    tok = make_tokenizer()
    model = make_tiny_model(tok, dtype=torch.float64)
    lengths = torch.tensor([3, 6])
    width = 6
    prompt = torch.full((2, width), tok.pad_token_id, dtype=torch.long)
    prompt[0, width - 3 :] = torch.tensor(tok("abc")["input_ids"])[:3]
    prompt[1] = torch.tensor(tok("abcdef")["input_ids"])[:6]
    mask = torch.arange(width)[None, :] >= (width - lengths)[:, None]
    outs = []
    for mask_key in (("masks", "all_attention_mask"), ("masks", "prompt_attention_mask")):
        wrapper = TransformersWrapper(model, tok, input_mode="tokens", generate=True, generate_kwargs={
            "max_new_tokens": 4, "generator": torch.Generator().manual_seed(0)})
        outs.append(wrapper(TensorDict({("tokens", "prompt"): prompt, mask_key: mask}, batch_size=[2])))
    torchrl_layout, tether_layout = outs
    full_mask = torchrl_layout["masks", "all_attention_mask"]
    prompt_tokens = (full_mask & ~torchrl_layout["masks", "all_assistant_mask"]).sum(-1)
    assert prompt_tokens.tolist() == [3, 6]
    for key in [("tokens", "full"), ("masks", "all_attention_mask"), ("log_probs", "full")]:
        assert torch.equal(torchrl_layout[key], tether_layout[key])
