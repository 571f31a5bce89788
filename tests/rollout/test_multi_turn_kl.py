"""Masks and KL across turns on a conversation built by hand with three assistant turns: user,
assistant (tool call), tool, assistant (a second call), tool, assistant (answer).

With the byte-level test tokenizer every character is one id and every special token one
id, so the expected mask is written down segment by segment below, independently of the
template code: True on each assistant turn's content and its ``<|im_end|>``, False on the
role headers, the newline after each ``<|im_end|>``, and everything the user and the tool
wrote. The KL (k1 in the reward, k3 in the loss) must then be the sum (or mean) over exactly
those tokens, computed here from two float64 models run naively over the whole row.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import CHATML, CHATML_GENERATION, make_tiny_model, make_tokenizer
from tests.llm.naive import naive_logprobs
from tether.llm import RetrieveKL, chat_batch
from tether.models import TransformersWrapper, tokenize_chats
from tether.objectives import GRPOLoss
from tether.ops import kl_k1, kl_k3, reward_to_go

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "7*6"}}</tool_call>'
CHECK = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
CHAT = [
    {"role": "user", "content": "7*6?"},
    {"role": "assistant", "content": CALL},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": CHECK},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "It is 42."},
]
START, END = "<|im_start|>", "<|im_end|>"
# (text, is it trained on): the ChatML rendering of CHAT, piece by piece.
SEGMENTS = [
    (START, False), ("user\n", False), ("7*6?", False), (END, False), ("\n", False),
    (START, False), ("assistant\n", False), (CALL, True), (END, True), ("\n", False),
    (START, False), ("tool\n", False), ("42", False), (END, False), ("\n", False),
    (START, False), ("assistant\n", False), (CHECK, True), (END, True), ("\n", False),
    (START, False), ("tool\n", False), ("42", False), (END, False), ("\n", False),
    (START, False), ("assistant\n", False), ("It is 42.", True), (END, True), ("\n", False),
]


def expected_mask() -> torch.Tensor:
    flags = []
    for text, trained in SEGMENTS:
        flags += [trained] * (1 if text in (START, END) else len(text.encode()))
    return torch.tensor(flags)


def test_expected_mask_by_hand():
    mask = expected_mask()
    # 6 turns of <|im_start|>, <|im_end|>, "\n" (18 ids); role lines user, 3 x assistant, 2 x tool
    # (5 + 30 + 10); contents 4 + 81 + 2 + 81 + 2 + 9. Trained: the 3 assistant contents + 3 <|im_end|>.
    assert len(CALL) == len(CHECK) == 81
    assert mask.numel() == 18 + 45 + 179 == 242
    assert int(mask.sum()) == 2 * (len(CALL) + 1) + len("It is 42.") + 1 == 174
    runs = int((mask[1:] & ~mask[:-1]).sum())
    assert runs == 3


@pytest.mark.parametrize("template", [CHATML, CHATML_GENERATION], ids=["split", "generation-block"])
def test_every_mask_position(template):
    tok = make_tokenizer(template)
    enc = tokenize_chats(tok, [CHAT])
    assert tok.decode(enc.input_ids[0]) == "".join(text for text, _ in SEGMENTS)
    assert enc.assistant_mask[0].tolist() == expected_mask().tolist()


@pytest.fixture(scope="module")
def models():
    tok = make_tokenizer()
    policy = make_tiny_model(tok, seed=0, dtype=torch.float64)
    reference = make_tiny_model(tok, seed=1, dtype=torch.float64)
    return tok, policy, reference


def naive(models):
    tok, policy, reference = models
    ids = tokenize_chats(tok, [CHAT]).input_ids[0]
    with torch.no_grad():
        return ids, naive_logprobs(policy, ids), naive_logprobs(reference, ids)


@pytest.mark.parametrize("estimator, fn", [("k1", kl_k1), ("k3", kl_k3)])
def test_retrieve_kl_sums_assistant_tokens_only(models, estimator, fn):
    tok, policy, reference = models
    ids, lp, ref_lp = naive(models)
    mask = expected_mask()
    scorer = lambda m, key: TransformersWrapper(m, tok, generate=False, log_probs_key=key)  # noqa: E731
    td = chat_batch([CHAT])
    td.set("reward", torch.tensor([[1.0]], dtype=torch.float64))
    out = RetrieveKL(scorer(policy, "log_probs"), scorer(reference, "ref_log_probs"), estimator=estimator,
                     coeff=0.5, padding_side="right")(td)
    kl = out["kl_penalty"][0]
    per_token = torch.where(mask, fn(lp, ref_lp), torch.zeros(()))
    torch.testing.assert_close(kl.double(), per_token, rtol=0, atol=1e-10)
    assert torch.all(kl[~mask] == 0)
    # Sum over the 3 assistant turns only, and the reward charged per token.
    torch.testing.assert_close(kl.double().sum(), per_token[mask].sum(), rtol=0, atol=1e-10)
    torch.testing.assert_close(out["reward"][0, :, 0].double(), 1.0 - 0.5 * per_token, rtol=0, atol=1e-10)


def test_grpo_kl_loss_is_the_mean_over_assistant_tokens(models):
    """k3 loss mode: kl_to_ref (token-mean) = mean of k3(logp, ref_logp) over the 3 turns."""
    tok, policy, reference = models
    ids, lp, ref_lp = naive(models)
    mask = expected_mask()
    td = chat_batch([CHAT])
    td.set(("tokens", "full"), ids[None])
    td.set(("masks", "all_attention_mask"), torch.ones(1, len(ids), dtype=torch.bool))
    td.set(("masks", "all_assistant_mask"), mask[None])
    td.set(("log_probs", "full"), (lp * mask)[None])
    td.set(("ref_log_probs", "full"), ref_lp[None])
    td.set("advantage", torch.zeros(1, 1, dtype=torch.float64))
    actor = TransformersWrapper(policy, tok, input_mode="tokens", generate=False)
    out = GRPOLoss(actor, kl_to_ref_coeff=1.0, kl_estimator="k3")(td)
    torch.testing.assert_close(out.kl_to_ref.double(), kl_k3(lp, ref_lp)[mask].mean(), rtol=0, atol=1e-10)


def test_reward_to_go_skips_tool_and_user_tokens(models):
    """k1 reward mode: the return at each assistant token is the sum of the k1 penalties of
    the assistant tokens at or after it; tokens of the tool, the user and the template get 0."""
    _, lp, ref_lp = naive(models)
    mask = expected_mask()
    penalty = -0.2 * (lp - ref_lp)
    got = reward_to_go((penalty * mask)[None], mask[None])[0]
    expected = torch.zeros_like(penalty)
    for t in range(len(mask)):
        if mask[t]:
            expected[t] = penalty[t:][mask[t:]].sum()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    first_turn_end = int(mask.nonzero()[len(CALL)])  # the <|im_end|> closing the tool call
    torch.testing.assert_close(got[first_turn_end], penalty[first_turn_end:][mask[first_turn_end:]].sum())
