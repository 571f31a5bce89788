"""Which scoring path a model takes: decided from its own logits, not from a list of names.

A model whose logits are ``lm_head(decoder(ids))`` is scored from hidden states; any other
(soft-capped, scaled, or a class that post-processes its logits in ways no config field
names) is scored through ``model(...).logits``. Either way the log-probs equal the naive
``log_softmax(model(ids).logits)`` values in float64.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaForCausalLM

from tether.models.scoring import causal_lm_parts, score_tokens
from tests.helpers import make_tiny_model, make_tokenizer
from tests.models.test_scoring import naive_row_logprobs


class HalvedLogits(LlamaForCausalLM):
    """A causal LM that scales its logits after the head; no config attribute says so."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out


def softcapped_gemma2() -> Gemma2ForCausalLM:
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          final_logit_softcapping=0.5, attn_logit_softcapping=None,
                          attn_implementation="eager")
    return Gemma2ForCausalLM(config).double().eval()


def halved_llama() -> HalvedLogits:
    plain = make_tiny_model(make_tokenizer(), dtype=torch.float64)
    model = HalvedLogits(plain.config).double().eval()
    model.load_state_dict(plain.state_dict())
    return model


def test_plain_head_is_scored_from_hidden_states():
    assert causal_lm_parts(make_tiny_model(make_tokenizer(), dtype=torch.float64)).decoder is not None


@pytest.mark.parametrize("build", [softcapped_gemma2, halved_llama], ids=["gemma2-softcap", "subclass-scales-logits"])
def test_post_processed_logits_take_the_logits_path_and_score_exactly(build):
    model = build()
    assert causal_lm_parts(model).decoder is None
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 60, (3, 7), generator=g)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[1, :2] = False  # left padding on one row
    got = score_tokens(model, tokens, mask).log_probs
    for row in range(3):
        valid = tokens[row][mask[row]]
        want = naive_row_logprobs(model, valid)
        torch.testing.assert_close(got[row][mask[row]].double(), want, rtol=0, atol=1e-10)


def test_probe_restores_training_flags():
    model = halved_llama().train()
    causal_lm_parts(model)
    assert all(m.training for m in model.modules())
