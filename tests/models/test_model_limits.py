"""Inputs a model cannot take are refused before its forward pass (issue 14).

Ids past the vocabulary, sequences past ``max_position_embeddings`` and empty or
right-padded prompts each get a ``ValueError`` naming the sizes and the fix, at the scoring
and sampling entry points.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from transformers import GPT2Config, GPT2LMHeadModel

from tether.models.sampling import sample_responses
from tether.models.scoring import exact_kl_tokens, score_tokens
from tether.models.wrapper import TransformersWrapper
from tests.helpers import make_tiny_model, make_tokenizer


def _gpt2(vocab: int = 260, positions: int = 8) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=16, n_layer=1, n_head=2)
    return GPT2LMHeadModel(config).eval()


def _short_llama(positions: int):
    model = make_tiny_model()
    model.config.max_position_embeddings = positions
    return model


def _ones(b: int, t: int) -> torch.Tensor:
    return torch.ones(b, t, dtype=torch.bool)


@pytest.fixture(scope="module")
def llama():
    return make_tiny_model()


def test_scoring_past_learned_positions_names_length_and_limit():
    """Before: a bare IndexError from GPT-2's position embedding (9 tokens, 8 positions)."""
    tokens = torch.arange(1, 10)[None]
    with pytest.raises(ValueError, match=r"tokens: the longest row has 9 tokens, but GPT2LMHeadModel has only "
                       r"8 positions \(config.max_position_embeddings\)\. Shorten"):
        score_tokens(_gpt2(), tokens, _ones(1, 9))


def test_scoring_at_the_position_limit_is_allowed():
    """Exactly ``max_position_embeddings`` tokens fit: the same log-probs as the model's own."""
    model, tokens = _gpt2(), torch.arange(1, 9)[None]
    got = score_tokens(model, tokens, _ones(1, 8)).log_probs
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.double()
    want = torch.log_softmax(logits[0, :-1], -1).gather(-1, tokens[0, 1:, None]).squeeze(-1)
    torch.testing.assert_close(got[0, 1:].double(), want, rtol=1e-5, atol=1e-5)


def test_scoring_past_rotary_positions_is_refused_too():
    """Before: a rotary model silently extrapolated past its trained context."""
    with pytest.raises(ValueError, match=r"longest row has 5 tokens.*only 4 positions"):
        score_tokens(_short_llama(4), torch.tensor([[1, 2, 3, 4, 5]]), _ones(1, 5))


def test_padding_does_not_count_towards_the_length():
    """A 4-token row padded to width 6 fits a 4-position model."""
    tokens = torch.tensor([[0, 0, 1, 2, 3, 4]])
    mask = torch.tensor([[False, False, True, True, True, True]])
    out = score_tokens(_short_llama(4), tokens, mask).log_probs
    assert out.shape == (1, 6) and bool((out[0, 3:] < 0).all())


def test_ids_past_the_vocabulary_name_both_sizes():
    """Before: a bare IndexError inside the embedding (reference vocab 100 < id 259)."""
    tokens = torch.tensor([[5, 6, 259]])
    with pytest.raises(ValueError, match=r"tokens: ids must lie in \[0, 100\), the vocabulary of GPT2LMHeadModel "
                       r"\(100 embedding rows\), but they span \[5, 259\] \(a vocabulary of at least 260\)"):
        score_tokens(_gpt2(vocab=100), tokens, _ones(1, 3))


def test_padding_ids_are_not_checked_against_the_vocabulary():
    """-100 / out-of-range ids on padding are never fed to the model and are allowed."""
    tokens = torch.tensor([[5, 6, 7, -100]])
    mask = torch.tensor([[True, True, True, False]])
    out = score_tokens(_gpt2(vocab=100), tokens, mask).log_probs
    assert out[0, 3] == 0 and bool((out[0, 1:3] < 0).all())


def test_exact_kl_checks_the_reference_vocabulary(llama):
    tokens = torch.tensor([[5, 6, 200]])
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 100\).*GPT2LMHeadModel.*span \[5, 200\]"):
        exact_kl_tokens(llama, _gpt2(vocab=100), tokens, _ones(1, 3))


def test_reference_wrapper_with_a_smaller_vocabulary_is_named():
    """A reference scorer (RetrieveKL / KLRewardTransform path) over fewer ids than the tokens."""
    wrapper = TransformersWrapper(_gpt2(vocab=100), input_mode="tokens", generate=False, pad_token_id=0)
    td = TensorDict({("tokens", "full"): torch.tensor([[5, 150]]),
                     ("masks", "all_attention_mask"): _ones(1, 2)}, batch_size=[1])
    with pytest.raises(ValueError, match=r"\[0, 100\).*\[5, 150\].*at least 151"):
        wrapper(td)


def _sample(model, ids, mask, **kwargs):
    options = {"max_new_tokens": 2, "eos_ids": [258], "pad_id": 259, **kwargs}
    return sample_responses(model, ids, mask, **options)


def test_sampling_refuses_prompt_plus_new_tokens_past_positions():
    """Before: rotary models sampled on past the limit; GPT-2 raised a bare IndexError."""
    with pytest.raises(ValueError, match=r"prompt_ids: the longest prompt has 3 tokens and max_new_tokens=6, so a "
                       r"sampled sequence .* may reach 9 tokens, but GPT2LMHeadModel has only 8 positions.*"
                       r"lower max_new_tokens"):
        _sample(_gpt2(), torch.tensor([[1, 2, 3]]), _ones(1, 3), max_new_tokens=6)
    out = _sample(_gpt2(), torch.tensor([[1, 2, 3]]), _ones(1, 3), max_new_tokens=5)
    assert out.tokens.shape[0] == 1


def test_sampling_refuses_prompt_ids_past_the_vocabulary():
    with pytest.raises(ValueError, match=r"prompt_ids: ids must lie in \[0, 100\).*span \[1, 120\]"):
        _sample(_gpt2(vocab=100), torch.tensor([[1, 120]]), _ones(1, 2))


@pytest.mark.parametrize(
    "ids, mask, pattern",
    [
        # Before: row 1 (no prompt token) was answered from the pad token at the last column.
        ([[1, 2, 3], [259, 259, 259]], [[1, 1, 1], [0, 0, 0]],
         r"prompt_mask: rows \[1\] \(of 2\) have no prompt token.*Drop empty prompts"),
        # The first token would be sampled after a pad: the layout is named instead.
        ([[1, 2, 3], [4, 5, 259]], [[1, 1, 1], [1, 1, 0]],
         r"rows \[1\] end on padding; sampling expects left-padded"),
    ],
)
def test_prompts_that_end_on_padding_are_refused(llama, ids, mask, pattern):
    with pytest.raises(ValueError, match=pattern):
        _sample(llama, torch.tensor(ids), torch.tensor(mask).bool())


def test_all_empty_prompt_batch_is_refused(llama):
    """Before: a ``[B, 0]`` prompt batch failed inside torch with a bare error."""
    with pytest.raises(ValueError, match=r"prompt_mask: rows \[0, 1\] \(of 2\) have no prompt token"):
        _sample(llama, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.bool))


def test_wrapper_refuses_an_empty_text_prompt(llama):
    """The wrapper's generate path reaches the same check (an empty string tokenises to [])."""
    tok = make_tokenizer()
    wrapper = TransformersWrapper(llama, tok, input_mode="text", generate_kwargs={"max_new_tokens": 2})
    td = TensorDict({("text", "prompt"): ["ab", ""]}, batch_size=[2])
    with pytest.raises(ValueError, match=r"rows \[1\] \(of 2\) have no prompt token"):
        wrapper(td)
