"""LLM KL components on lazily stacked TensorDicts of unpadded rows (TorchRL collectors' layout).

``td.get`` refuses entries whose rows differ in length on a lazy stack; the components read
them as jagged rows and write jagged results, which the lazy stack hands back row by row.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, lazy_stack

from tests.helpers import make_tiny_model, make_tokenizer
from tests.llm.naive import MULTI_TURN, rows, token_rows
from tether.llm import KLComputation, RetrieveKL, RetrieveLogProb, chat_batch
from tether.models import TransformersWrapper

REWARD = torch.tensor([[1.0], [-0.5], [2.0]], dtype=torch.float64)
PER_TOKEN = [("tokens", "full"), ("masks", "all_attention_mask"), ("masks", "all_assistant_mask")]


def scorers(tok, policy, reference):
    gen = TransformersWrapper(policy, tok, generate=False, pad_output=False)
    ref = TransformersWrapper(reference, tok, generate=False, pad_output=False, log_probs_key="ref_log_probs")
    return gen, ref


def lazy_rows(td):
    """One 0-dim TensorDict per row holding its unpadded tokens, masks and reward."""
    out = []
    for b, ids in enumerate(token_rows(td)):
        row = TensorDict({"reward": REWARD[b]}, batch_size=[])
        for key in PER_TOKEN:
            row[key] = rows(td, key)[b] if key != ("tokens", "full") else ids
        out.append(row)
    return lazy_stack(out)


def test_retrieve_and_kl_on_a_lazy_stack_match_the_jagged_batch():
    """The same three chats (lengths differ) scored as one jagged TensorDict and as a lazy
    stack of unpadded rows: per-row policy and reference log-probs, KL and reward agree to
    float64 round-off, whether the steps run one by one or through RetrieveKL."""
    tok = make_tokenizer()
    policy = make_tiny_model(tok, dtype=torch.float64)
    reference = make_tiny_model(tok, dtype=torch.float64, seed=1)
    gen, ref = scorers(tok, policy, reference)
    plain = chat_batch(MULTI_TURN)
    plain["reward"] = REWARD.clone()
    expected = RetrieveKL(gen, ref, coeff=0.5)(plain)
    lengths = [len(r) for r in token_rows(expected)]
    assert len(set(lengths)) == 3
    stepwise = lazy_rows(expected)
    stepwise = KLComputation(coeff=0.5)(RetrieveLogProb(ref)(RetrieveLogProb(gen)(stepwise)))
    composite = RetrieveKL(gen, ref, coeff=0.5)(lazy_rows(expected))
    for out in (stepwise, composite):
        for b, row in enumerate(out.tensordicts):
            for key in [("log_probs", "full"), ("ref_log_probs", "full"), "kl_penalty", "reward"]:
                want = rows(expected, key)[b]
                torch.testing.assert_close(row[key].reshape(want.shape), want, rtol=0, atol=1e-12)
