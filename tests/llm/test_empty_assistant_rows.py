"""A chat without an assistant turn is refused by assistant-only scoring (issue 14).

Before, its assistant mask was all False and ``assistant_only=True`` zeroed its whole row:
the reference log-probs and the KL built on them silently contributed nothing.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.helpers import make_tiny_model, make_tokenizer
from tests.llm.naive import naive_logprobs, rows, token_rows
from tether.llm import KLRewardTransform, RetrieveKL, RetrieveLogProb, chat_batch
from tether.models import TransformersWrapper

ANSWERED = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
UNANSWERED = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
ERROR = r"\('masks', 'all_assistant_mask'\): rows \[1\] \(of 3\) have no assistant token.*assistant_only=False"


@pytest.fixture(scope="module")
def setup():
    tok = make_tokenizer()
    return tok, make_tiny_model(tok, dtype=torch.float64)


def _scorer(tok, model, **kw):
    return TransformersWrapper(model, tok, generate=False, **kw)


def test_retrieve_log_prob_names_the_chat_without_an_assistant_turn(setup):
    tok, model = setup
    with pytest.raises(ValueError, match=ERROR):
        RetrieveLogProb(_scorer(tok, model))(chat_batch([ANSWERED, UNANSWERED, ANSWERED]))


def test_without_assistant_only_every_token_is_scored(setup):
    """The defined behaviour for prompts to be scored whole: the row holds real log-probs."""
    tok, model = setup
    td = RetrieveLogProb(_scorer(tok, model), assistant_only=False)(chat_batch([ANSWERED, UNANSWERED]))
    ids, lp = token_rows(td)[1], rows(td, ("log_probs", "full"))[1]
    torch.testing.assert_close(lp, naive_logprobs(model, ids), rtol=0, atol=1e-10)
    assert bool((lp[1:] < 0).all())


def test_tokens_with_an_empty_assistant_row_are_refused(setup):
    """The same check applies to tokens and masks already in the batch."""
    tok, model = setup
    mask = torch.ones(3, 4, dtype=torch.bool)
    td = TensorDict({
        ("tokens", "full"): torch.tensor([[5, 6, 7, 8]] * 3),
        ("masks", "all_attention_mask"): mask,
        ("masks", "all_assistant_mask"): torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0], [0, 1, 1, 1]]).bool(),
    }, batch_size=[3])
    with pytest.raises(ValueError, match=ERROR):
        RetrieveLogProb(_scorer(tok, model, input_mode="tokens"))(td)


def test_kl_transforms_refuse_it_before_writing_a_kl(setup):
    """RetrieveKL and KLRewardTransform score through RetrieveLogProb: same error, no KL."""
    tok, model = setup
    gen = _scorer(tok, model)
    ref = _scorer(tok, make_tiny_model(tok, seed=1, dtype=torch.float64), log_probs_key="ref_log_probs")
    td = chat_batch([ANSWERED, UNANSWERED, ANSWERED])
    td.set("reward", torch.ones(3))
    with pytest.raises(ValueError, match=ERROR):
        RetrieveKL(gen, ref, add_to_reward=False)(td.clone())
    td.set(("log_probs", "full"), torch.zeros(3, 1))
    with pytest.raises(ValueError, match=ERROR):
        KLRewardTransform(ref, log_prob_key=("log_probs", "full"))(td)
    assert "kl_penalty" not in td.keys()
