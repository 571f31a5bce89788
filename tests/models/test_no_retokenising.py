"""A scorer never re-tokenises a batch that already holds its tokens.

A ``TransformersWrapper(generate=False)`` in ``"history"`` or ``"text"`` mode renders
``(input_mode, "full")`` again; on a batch a sampler produced, the rendered chat differs from
the sampled tokens (the sampled answer stops without the template's closing text), and writing
it would silently replace ``("tokens", "full")`` under the sampling log-probs. It refuses,
naming ``input_mode="tokens"``; rendering that gives the same tokens goes through.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tether.llm import chat_batch
from tether.models import TransformersWrapper
from tether.models.tiny import byte_tokenizer, tiny_causal_lm
from tether.objectives import GRPOLoss

F64 = torch.float64
PROMPTS = [[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "what is 2+2?"}]]


@pytest.fixture(scope="module")
def parts():
    tok = byte_tokenizer()
    return tok, tiny_causal_lm(tok, seed=0, dtype=F64)


def sampled(parts) -> TensorDict:
    tok, model = parts
    sampler = TransformersWrapper(model, tok, generate_kwargs={"max_new_tokens": 4,
                                                               "generator": torch.Generator().manual_seed(0)})
    return sampler(chat_batch(PROMPTS, key=("history", "prompt")))


@pytest.mark.parametrize("input_mode", ["history", "text"])
def test_scorer_refuses_to_overwrite_sampled_tokens(parts, input_mode):
    """Four new tokens stop before the end-of-turn text that the chat template adds, so the
    re-rendered rows are longer than the sampled ones; the scorer raises before writing, and
    the batch still holds the sampled tokens, bit for bit."""
    tok, model = parts
    td = sampled(parts)
    before = td["tokens", "full"].clone()
    ref = TransformersWrapper(model, tok, input_mode=input_mode, generate=False, log_probs_key="ref_log_probs")
    with pytest.raises(ValueError, match=r"\('tokens', 'full'\).*re-renders.*input_mode='tokens'"):
        ref(td)
    assert torch.equal(td["tokens", "full"], before)
    assert ("ref_log_probs", "full") not in td.keys(include_nested=True)


def test_tokens_mode_scorer_scores_the_sampled_tokens(parts):
    """The fix the error names: in ``input_mode="tokens"`` the reference scores the batch's
    own tokens, equal to a direct ``score`` of them, and leaves them as they were."""
    tok, model = parts
    td = sampled(parts)
    before, mask = td["tokens", "full"].clone(), td["masks", "all_attention_mask"]
    ref = TransformersWrapper(model, tok, input_mode="tokens", generate=False, log_probs_key="ref_log_probs")
    with torch.no_grad():
        ref(td)
        direct = ref.score(before, mask).log_probs
    assert torch.equal(td["tokens", "full"], before)
    torch.testing.assert_close(td["ref_log_probs", "full"], torch.where(mask, direct, 0.0), rtol=0, atol=1e-12)


def test_rendering_that_matches_the_held_tokens_goes_through(parts):
    """Two history-mode scorers on one batch of complete chats: the second renders exactly the
    tokens the first wrote, so it scores them; its log-probs equal those of a fresh batch."""
    tok, model = parts
    chats = [p + [{"role": "assistant", "content": "4"}] for p in PROMPTS]
    first = TransformersWrapper(model, tok, generate=False, log_probs_key="a")
    second = TransformersWrapper(tiny_causal_lm(tok, seed=1, dtype=F64), tok, generate=False, log_probs_key="b")
    with torch.no_grad():
        td = second(first(chat_batch(chats)))
        fresh = second(chat_batch(chats))
    torch.testing.assert_close(td["b", "full"], fresh["b", "full"], rtol=0, atol=0)


def test_grpo_loss_names_where_each_width_came_from(parts):
    """Reference log-probs three columns wider than the tokens: the error names the tokens'
    key with their [B, T], the entry's key with its shape, and the fix."""
    tok, model = parts
    td = sampled(parts)
    b, t = td["tokens", "full"].shape
    td.set(("ref_log_probs", "full"), torch.zeros(b, t + 3, dtype=F64))
    td.set("advantage", torch.ones(b, dtype=F64))
    loss = GRPOLoss(TransformersWrapper(model, tok, input_mode="tokens", generate=False), kl_to_ref_coeff=0.1)
    pattern = (rf"\('ref_log_probs', 'full'\).*\[B, T\] = \({b}, {t}\).*\('tokens', 'full'\).*\({b}, {t + 3}\)"
               r".*input_mode='tokens'")
    with pytest.raises(ValueError, match=pattern):
        loss(td)


def test_kl_computation_names_both_entries_and_the_fix():
    """Sampling log-probs over 5 tokens, reference log-probs over 7 (a re-rendered chat): the
    error names both keys with their shapes, in that order, and input_mode='tokens'."""
    from tether.llm import KLComputation

    td = TensorDict({("log_probs", "full"): torch.zeros(1, 5), ("ref_log_probs", "full"): torch.zeros(1, 7)}, [1])
    pattern = (r"\('log_probs', 'full'\) and \('ref_log_probs', 'full'\).*shapes \(1, 5\) and \(1, 7\) "
               r"\(\('log_probs', 'full'\) first\).*input_mode='tokens'")
    with pytest.raises(ValueError, match=pattern):
        KLComputation(add_to_reward=False)(td)
