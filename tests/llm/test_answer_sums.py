"""``answer_sums``: a per-token entry reduced to one number per answer, over its tokens only.

A KL transform copies a per-answer reward onto every valid token of the reward grid, so the
grid's row sum counts it once per token; the answer's return is the reward minus ``coef``
times the answer's summed KL, which these tests derive by hand and from full logits.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.helpers import make_tiny_model, make_tokenizer
from tests.llm.naive import naive_logprobs
from tether.llm import KLRewardTransform, answer_sums, chat_batch
from tether.models import TransformersWrapper, tokenize_chats

F64 = torch.float64
CHATS = [
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, or red."}],
]


def test_padded_left_hand_values():
    """Two left-padded rows of width 4, values [B, T, 1]. Row 0 (one pad): attention 0111,
    assistant 0011, values (7, 9, 0.5, 0.25) -> 0.5 + 0.25 = 0.75. Row 1: attention 1111,
    assistant 0001, values (9, 9, 9, -2) -> -2. With mask_key=None every valid token counts:
    9 + 0.5 + 0.25 = 9.75 and 9 + 9 + 9 - 2 = 25 (the padding's 7 never counts)."""
    td = TensorDict({
        "v": torch.tensor([[7.0, 9.0, 0.5, 0.25], [9.0, 9.0, 9.0, -2.0]], dtype=F64)[..., None],
        ("masks", "all_attention_mask"): torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]).bool(),
        ("masks", "all_assistant_mask"): torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]]).bool(),
    }, batch_size=[2])
    assert answer_sums(td, "v").tolist() == [0.75, -2.0]
    assert answer_sums(td, "v", mask_key=None).tolist() == [9.75, 25.0]


def test_one_value_per_answer_passes_through():
    """[B, 1, 1] already holds one number per answer: returned as [B]."""
    td = TensorDict({("next", "reward"): torch.tensor([1.0, 0.0]).reshape(2, 1, 1)}, batch_size=[2])
    assert answer_sums(td, ("next", "reward")).tolist() == [1.0, 0.0]


@pytest.fixture(scope="module")
def models():
    tok = make_tokenizer()
    return tok, make_tiny_model(tok, dtype=F64), make_tiny_model(tok, dtype=F64, seed=1)


@pytest.mark.parametrize("layout", ["padded", "jagged", "lazy-stack"])
def test_return_of_a_kl_shaped_per_answer_reward(models, layout):
    """Rewards r = (1, 0) per answer and coef 0.05. KLRewardTransform writes r_b - 0.05 kl_t on
    every valid token; the return is r_b - 0.05 * sum_t kl_t over the assistant tokens, with
    kl_t = log pi - log pi_ref from full logits. The grid's own row sum is not it: it counts
    r_b once per valid token (n_b r_b - 0.05 sum_t kl_t)."""
    tok, policy, reference = models
    pad = layout == "padded"
    batch = chat_batch(CHATS)
    if layout == "lazy-stack":
        batch = batch.to_lazystack(0)
    TransformersWrapper(policy, tok, generate=False, pad_output=pad)(batch)
    batch["next"] = TensorDict({"reward": torch.tensor([[1.0], [0.0]], dtype=F64)}, batch_size=[2])
    if layout == "lazy-stack":
        batch["next"] = batch["next"].to_lazystack(0)
    ref = TransformersWrapper(reference, tok, input_mode="tokens", generate=False, pad_output=pad)
    batch = KLRewardTransform(ref, coef=0.05)(batch)
    enc = tokenize_chats(tok, CHATS)
    kl = [((naive_logprobs(policy, ids) - naive_logprobs(reference, ids)) * m).sum() for ids, m in
          zip(enc.input_ids, enc.assistant_mask)]
    expected = torch.tensor([1.0, 0.0], dtype=F64) - 0.05 * torch.stack(kl)
    got = torch.tensor([1.0, 0.0], dtype=F64) - 0.05 * answer_sums(batch, ("next", "kl_penalty"))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)
    lengths = torch.tensor([len(ids) for ids in enc.input_ids], dtype=F64)
    grid_sum = answer_sums(batch, ("next", "reward"), mask_key=None)
    torch.testing.assert_close(grid_sum, lengths * torch.tensor([1.0, 0.0], dtype=F64) - 0.05 * torch.stack(kl),
                               rtol=0, atol=1e-9)


def test_errors_name_the_key_and_the_fix():
    td = TensorDict({"v": torch.zeros(2, 3)}, batch_size=[2])
    with pytest.raises(KeyError, match=r"'kl_penalty'.*KLRewardTransform"):
        answer_sums(td)
    with pytest.raises(KeyError, match=r"all_assistant_mask.*mask_key=None"):
        answer_sums(td, "v")
    td["masks", "all_assistant_mask"] = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"all_assistant_mask.*expected a mask of shape \(2, 3\)"):
        answer_sums(td, "v")
