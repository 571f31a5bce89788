"""Episode ends, step views and memory of ``create_rollout_td`` on hand-made responses.

Responses are written by hand (no sampling) so that every ending is present: an eos in the
middle, an eos at the very last step, no eos at all, and an eos as the first token, with
pad == eos and prompts that contain the eos id.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_tiny_model, make_tokenizer
from tests.rollout.builders import EOS, end_score, prompt_batch, reward_model, storage_bytes
from tether.rollout import RolloutFromModel, episode_ends, stepwise_views

PROMPTS = [[257, EOS, 5], [257, 6], [257, EOS, EOS], [257]]
ACTIONS = [[7, EOS, EOS, EOS], [7, 8, 9, EOS], [7, 8, 9, 10], [EOS, EOS, EOS, EOS]]
REFERENCE = [[40, EOS], [41, 42], [43], [44, 45, EOS]]
DONE_INDEX = [1, 3, 3, 0]
HAS_EOS = [True, True, False, True]


def build(*, score_clip=10.0, kl_coef=0.5, materialize_steps=False, max_new_tokens=4, pad_is_eos=True):
    tok = make_tokenizer(pad_is_eos=pad_is_eos)
    model = make_tiny_model(tok, dtype=torch.float64)
    rollout = RolloutFromModel(model, model, reward_model(), kl_coef=kl_coef, max_new_tokens=max_new_tokens,
                               score_clip=score_clip, tokenizer=tok, materialize_steps=materialize_steps)
    return tok, rollout


def generated_for(batch, actions, pad):
    """``[B, L + N]``: each prompt, its actions at prompt_rindex, pad after."""
    size, width = batch.input_ids.shape
    steps = len(actions[0])
    out = torch.full((size, width + steps), pad, dtype=torch.long)
    for b, (prompt, action) in enumerate(zip(PROMPTS, actions)):
        out[b, : len(prompt)] = torch.tensor(prompt)
        out[b, len(prompt) : len(prompt) + steps] = torch.tensor(action)
    return out


def test_done_terminated_truncated_and_rewards_on_hand_made_responses():
    """Done index = first eos of the response (else N - 1), never moved by eos in the prompt.

    Row 1 samples eos at the last step: terminated (the seed called it truncated). Row 2 has
    no eos: truncated. With log_ratio = 1 everywhere, reward_kl = -0.5 on steps 0..done and 0
    after, and the queued per-sequence KL is the number of kept tokens [2, 4, 4, 1]. With
    score_clip = 1e-3 the raw reward at the done step is 1e-3 * sign(score(row) -
    score(reference)), where the scored row keeps its eos.
    """
    tok, rollout = build(score_clip=1e-3)
    batch = prompt_batch(PROMPTS, REFERENCE, pad=EOS)
    generated = generated_for(batch, ACTIONS, EOS)
    ones = torch.ones(4, 4)
    td = rollout.create_rollout_td(batch, generated, torch.full((4, 4, 1), -1.5), ones)
    done = td["next", "done"][..., 0]
    assert done.sum(-1).tolist() == [1, 1, 1, 1]
    assert done.int().argmax(-1).tolist() == DONE_INDEX
    assert td["next", "terminated"][..., 0].any(-1).tolist() == HAS_EOS
    assert td["next", "truncated"][..., 0].any(-1).tolist() == [not e for e in HAS_EOS]
    assert torch.equal(td["next", "terminated"] | td["next", "truncated"], td["next", "done"])
    expected_kl = torch.tensor([[-0.5 if i <= d else 0.0 for i in range(4)] for d in DONE_INDEX])
    assert torch.equal(td["next", "reward_kl"][..., 0], expected_kl)
    assert torch.equal(td["sample_log_prob"][..., 0], torch.where(expected_kl != 0, -1.5, 0.0))
    assert rollout.queued_kl.tolist() == [2.0, 4.0, 4.0, 1.0]
    for b, d in enumerate(DONE_INDEX):
        row = torch.tensor(PROMPTS[b] + ACTIONS[b][: d + 1])
        diff = end_score(rollout.reward_model, row) - end_score(rollout.reward_model, torch.tensor(PROMPTS[b] + REFERENCE[b]))
        assert abs(diff) > 1e-3  # so the clip is really exercised
        raw = td["next", "reward_raw"][b, :, 0]
        assert raw[d].item() == pytest.approx(1e-3 if diff > 0 else -1e-3, abs=1e-9)
        assert torch.count_nonzero(raw) == 1


def test_episode_ends_with_several_eos_ids():
    action = torch.tensor([[5, 9, 7, 9], [1, 2, 3, 4], [7, 1, 1, 1]])
    ends = episode_ends(action, (7, 9))
    assert ends.done_index.tolist() == [1, 3, 0]
    assert ends.has_eos.tolist() == [True, False, True]
    assert ends.step_mask.sum(-1).tolist() == [2, 4, 1]


def test_step_views_equal_naive_prefixes_and_are_lazy_by_default():
    """Step i sees the prompt and the first min(i, n) response tokens; next sees min(i + 1, n).

    Built naively with loops over rows and steps, compared with the materialised keys, with
    ``stepwise_views`` of the default output, and with ``stepwise_views`` of a time slice.
    """
    tok, lazy = build()
    _, eager = build(materialize_steps=True)
    batch = prompt_batch(PROMPTS, REFERENCE, pad=EOS)
    generated = generated_for(batch, ACTIONS, EOS)
    zeros = torch.zeros(4, 4)
    td_lazy = lazy.create_rollout_td(batch, generated, zeros, zeros)
    td_eager = eager.create_rollout_td(batch, generated, zeros, zeros)
    width = generated.shape[1]
    ids = torch.full((4, 4, width), EOS)
    next_ids = torch.full((4, 4, width), EOS)
    mask = torch.zeros(4, 4, width, dtype=torch.bool)
    next_mask = torch.zeros(4, 4, width, dtype=torch.bool)
    for b, d in enumerate(DONE_INDEX):
        n, p = d + 1, len(PROMPTS[b])
        for i in range(4):
            seen, seen_next = p + min(i, n), p + min(i + 1, n)
            ids[b, i, :seen], mask[b, i, :seen] = generated[b, :seen], True
            next_ids[b, i, :seen_next], next_mask[b, i, :seen_next] = generated[b, :seen_next], True
    assert "input_ids" not in td_lazy.keys() and ("next", "input_ids") not in td_lazy.keys(True)
    assert torch.equal(td_eager["input_ids"], ids) and torch.equal(td_eager["attention_mask"], mask)
    assert torch.equal(td_eager["next", "input_ids"], next_ids)
    assert torch.equal(td_eager["next", "attention_mask"], next_mask)
    views = lazy.stepwise_views(td_lazy)
    assert torch.equal(views.input_ids, ids) and torch.equal(views.next_attention_mask, next_mask)
    sliced = stepwise_views(td_lazy[:, 2], EOS)
    assert torch.equal(sliced.next_input_ids, next_ids[:, 2]) and torch.equal(sliced.attention_mask, mask[:, 2])


def test_default_output_memory_is_linear_in_max_new_tokens():
    """Allocated bytes of the default output are affine in N: b(16) - b(8) == 2 (b(8) - b(4)).

    The materialised step views grow like N (L + N), so the same identity fails for them,
    which shows the measurement can tell the two apart.
    """
    def bytes_at(steps, materialize):
        tok, rollout = build(max_new_tokens=steps, materialize_steps=materialize, pad_is_eos=False)
        batch = prompt_batch(PROMPTS, REFERENCE, pad=259)
        actions = [[7] * steps for _ in PROMPTS]
        generated = generated_for(batch, actions, 259)
        zeros = torch.zeros(4, steps)
        return storage_bytes(rollout.create_rollout_td(batch, generated, zeros, zeros))

    lazy = [bytes_at(n, False) for n in (4, 8, 16)]
    assert lazy[2] - lazy[1] == 2 * (lazy[1] - lazy[0])
    eager = [bytes_at(n, True) for n in (4, 8, 16)]
    assert eager[2] - eager[1] > 2 * (eager[1] - eager[0])
    assert lazy[2] < eager[2] / 4
