"""Integration: RetrieveKL on the real SmolLM2-135M-Instruct over multi-turn chats."""

from __future__ import annotations

import pytest
import torch

from tests.llm.naive import naive_logprobs, rows, token_rows
from tether.llm import RetrieveKL, chat_batch
from tether.models import TransformersWrapper, frozen_copy

CHATS = [
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Green, like grass."},
    ],
    [
        {"role": "system", "content": "You answer with numbers only."},
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "And 10 - 8?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "Times five?"},
        {"role": "assistant", "content": "10"},
    ],
    [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi there! How can I help you today?"},
    ],
]
REWARD = torch.tensor([[1.0], [0.5], [-1.0]])


def runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    padded = torch.cat([mask.new_zeros(1), mask, mask.new_zeros(1)]).int()
    edges = padded.diff().nonzero().flatten().tolist()
    return list(zip(edges[::2], edges[1::2]))


@pytest.mark.integration
def test_retrieve_kl_matches_full_logits_on_the_embedded_model(embedded):
    """Policy and (perturbed) reference log-probs, KL and reward match a plain
    full-logits / log_softmax / gather computation within 1e-4; each assistant turn, with
    its <|im_end|> (id 2, which is also the pad id), is one masked run; the KL is exactly 0
    against a scorer over the same weights."""
    model, tok = embedded
    reference = frozen_copy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in reference.model.layers[-1].mlp.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=generator))
    policy = TransformersWrapper(model, tok, generate=False)
    ref = TransformersWrapper(reference, tok, generate=False, log_probs_key="ref_log_probs")
    td = chat_batch(CHATS)
    td["reward"] = REWARD.clone()
    td = RetrieveKL(policy, ref, coeff=0.1)(td)

    assistant = rows(td, ("masks", "all_assistant_mask"))
    with torch.no_grad():
        for b, (chat, ids, asst) in enumerate(zip(CHATS, token_rows(td), assistant)):
            turns = [m["content"] + "<|im_end|>" for m in chat if m["role"] == "assistant"]
            spans = runs(asst)
            assert [tok.decode(ids[s:e]) for s, e in spans] == turns
            assert all(int(ids[e - 1]) == 2 for _, e in spans)
            gen_lp = torch.where(asst, naive_logprobs(model, ids), 0.0)
            ref_lp = torch.where(asst, naive_logprobs(reference, ids), 0.0)
            for key, expected in ((("log_probs", "full"), gen_lp), (("ref_log_probs", "full"), ref_lp),
                                  ("kl_penalty", gen_lp - ref_lp)):
                torch.testing.assert_close(rows(td, key)[b].double(), expected, rtol=0, atol=1e-4)
            torch.testing.assert_close(rows(td, "reward")[b].squeeze(-1).double(),
                                       REWARD[b].double() - 0.1 * (gen_lp - ref_lp), rtol=0, atol=1e-4)
            assert (gen_lp - ref_lp)[asst].abs().max() > 1e-3

    same = TransformersWrapper(model, tok, generate=False, log_probs_key="same")
    td = RetrieveKL(policy, same, add_to_reward=False)(chat_batch(CHATS))
    assert torch.all(td["kl_penalty"] == 0)
