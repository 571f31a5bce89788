"""Every public scoring entry point reaches the one padding-free engine and returns its values.

The reference values are ``TransformersWrapper.score`` (``tether.models.scoring.score_tokens``)
of the chats' own token ids, float64 on a tiny model; each entry point must return them
(zeroed outside the assistant mask where it is assistant-only) to 1e-12, and the decoder must
see only the chats' real tokens, never a padded ``[B, T]`` grid.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

from tests.helpers import make_tiny_model, make_tokenizer
from tests.llm.naive import MULTI_TURN, rows, token_rows
from tether.llm import KLRewardTransform, RetrieveKL, RetrieveLogProb, chat_batch
from tether.models import TransformersWrapper, frozen_copy, tokenize_chats

ATOL = 1e-12


@pytest.fixture(scope="module")
def models():
    tok = make_tokenizer()
    torch.manual_seed(0)
    policy = make_tiny_model(tok, dtype=torch.float64)
    reference = frozen_copy(policy)
    with torch.no_grad():  # a reference that differs from the policy, so the KL is not 0
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return tok, policy, reference


def wrapper(tok, model, **kw):
    return TransformersWrapper(model, tok, generate=False, **kw)


def engine_rows(tok, model) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(ids, assistant mask, log-probs) per chat from ``score`` on right-padded chat tokens."""
    enc = tokenize_chats(tok, MULTI_TURN)
    ids = pad_sequence(enc.input_ids, batch_first=True, padding_value=0)
    mask = pad_sequence([torch.ones_like(r, dtype=torch.bool) for r in enc.input_ids], batch_first=True)
    with torch.no_grad():
        lp = wrapper(tok, model).score(ids, mask).log_probs
    return enc.input_ids, enc.assistant_mask, [row[m] for row, m in zip(lp, mask)]


def assert_rows(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=ATOL)


def assistant_only(values, masks):
    return [torch.where(m, v, 0.0) for v, m in zip(values, masks)]


def test_retrieve_log_prob_on_chats_and_on_tokens(models):
    """History mode (chats only) and tokens already in the batch give the engine's values."""
    tok, policy, _ = models
    ids, asst, lp = engine_rows(tok, policy)
    module = RetrieveLogProb(wrapper(tok, policy))
    td = module(chat_batch(MULTI_TURN))
    assert_rows(token_rows(td), ids)
    assert_rows(rows(td, ("log_probs", "full")), assistant_only(lp, asst))
    again = module(td.exclude(("log_probs", "full")))
    assert_rows(rows(again, ("log_probs", "full")), assistant_only(lp, asst))


@pytest.mark.parametrize("reuse", [False, True])
def test_retrieve_kl_policy_and_reference(models, reuse):
    """Both log-probs are the engine's; the k1 KL is their difference on assistant tokens.
    ``reuse``: the policy's log-probs are already in the batch (gen_model=None)."""
    tok, policy, reference = models
    _, asst, gen = engine_rows(tok, policy)
    _, _, ref = engine_rows(tok, reference)
    td = chat_batch(MULTI_TURN)
    if reuse:
        td = RetrieveLogProb(wrapper(tok, policy))(td)
    gen_model = None if reuse else wrapper(tok, policy)
    out = RetrieveKL(gen_model, wrapper(tok, reference, log_probs_key="ref_log_probs"), add_to_reward=False)(td)
    assert_rows(rows(out, ("log_probs", "full")), assistant_only(gen, asst))
    assert_rows(rows(out, ("ref_log_probs", "full")), assistant_only(ref, asst))
    assert_rows(rows(out, "kl_penalty"), assistant_only([g - r for g, r in zip(gen, ref)], asst))


def test_kl_reward_transform(models):
    """The reference's log-probs are the engine's; the reward is r - coef * (log pi - log pi_ref)
    summed nowhere: per token, with the per-sequence reward 1.0 broadcast on assistant tokens."""
    tok, policy, reference = models
    _, asst, gen = engine_rows(tok, policy)
    _, _, ref = engine_rows(tok, reference)
    td = RetrieveLogProb(wrapper(tok, policy))(chat_batch(MULTI_TURN))
    td.set("reward", torch.ones(len(MULTI_TURN), 1, dtype=torch.float64))
    out = KLRewardTransform(wrapper(tok, reference), coef=0.5, log_prob_key=("log_probs", "full"))(td)
    assert_rows(rows(out, "ref_log_prob"), assistant_only(ref, asst))
    kl = assistant_only([g - r for g, r in zip(gen, ref)], asst)
    assert_rows(rows(out, "kl_penalty"), kl)


def test_reference_service_body(models):
    """The Ray service's actor body scores a request with the engine (no cluster needed)."""
    pytest.importorskip("ray")
    from tether.ray.reference_client import ScoreRequest
    from tether.ray.reference_service import BatchLimits, ReferenceServer

    tok, _, reference = models
    ids, _, ref = engine_rows(tok, reference)
    tokens = pad_sequence(ids, batch_first=True, padding_value=0, padding_side="left")
    mask = pad_sequence([torch.ones_like(r, dtype=torch.bool) for r in ids], batch_first=True, padding_side="left")
    server = ReferenceServer(wrapper(tok, reference), None, BatchLimits(), None, 16)
    [reply] = server._forward([ScoreRequest("a", tokens, mask)])
    assert_rows([row[m] for row, m in zip(reply.log_probs, mask)], ref)


@pytest.mark.parametrize("inputs", ["chats", "tokens"])
def test_history_mode_decoder_sees_only_real_tokens(models, inputs):
    """RetrieveLogProb on chats only (history mode) and on tokens in the batch runs the decoder
    through the engine's plan: with a token budget of 1 every row is its own pass, so the decoder
    sees exactly sum(row lengths) tokens in len(chats) calls; a padded [B, T] forward would see
    B * max(length) tokens in one call."""
    tok, policy, _ = models
    ids, _, _ = engine_rows(tok, policy)
    seen: list[int] = []
    decoder = policy.get_decoder()
    handle = decoder.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw["input_ids"].numel()),
                                               with_kwargs=True)
    try:
        module = RetrieveLogProb(wrapper(tok, policy, token_budget=1, share_prefix=False))
        td = chat_batch(MULTI_TURN)
        if inputs == "tokens":
            td = module(td).exclude(("log_probs", "full"))
        seen.clear()
        module(td)
    finally:
        handle.remove()
    lengths = [len(r) for r in ids]
    assert seen and sum(seen) == sum(lengths) < len(lengths) * max(lengths)
    assert sorted(seen, reverse=True) == sorted(lengths, reverse=True)


@pytest.mark.parametrize("assistant_only", [True, False])
def test_assistant_only_runs_the_head_at_assistant_tokens_only(models, assistant_only):
    """Through RetrieveKL on chats (policy scores the chats, reference the tokens it wrote), the
    output head sees exactly the assistant tokens of each row (minus a row's first token) per
    model when assistant_only, and every valid position but the first otherwise."""
    from unittest import mock

    from tether.models import score_plan

    tok, policy, reference = models
    ids, asst, _ = engine_rows(tok, policy)
    seen: list[int] = []
    real = score_plan.token_stats_from_hidden

    def counting(hidden, *args, **kwargs):
        seen.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
        return real(hidden, *args, **kwargs)

    module = RetrieveKL(wrapper(tok, policy), wrapper(tok, reference, log_probs_key="ref_log_probs"),
                        assistant_only=assistant_only, add_to_reward=False)
    with mock.patch.object(score_plan, "token_stats_from_hidden", counting):
        module(chat_batch(MULTI_TURN))
    per_model = sum(int(m[1:].sum()) for m in asst) if assistant_only else sum(len(r) - 1 for r in ids)
    assert sum(seen) == 2 * per_model
