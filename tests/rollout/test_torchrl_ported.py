"""TorchRL's ``RolloutFromModel`` tests (``test/test_rlhf.py::TestRollout``) on tether's API.

Tiny float64 models instead of a random GPT-2 and tether's ``PromptBatch`` instead of the TL;DR
dataset; each test states what it carries over and checks values, not only shapes.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_tokenizer
from tests.rollout.builders import EOS, prompt_batch, token_log_probs
from tests.rollout.test_rollout import COMPLETIONS, PROMPTS, make_rollout
from tests.rollout.test_steps import ACTIONS, DONE_INDEX, REFERENCE, build, generated_for
from tests.rollout.test_steps import PROMPTS as STEP_PROMPTS

MAX_NEW = 6


def test_generate_shapes_and_sampled_log_probs():
    """Ports ``TestRollout::test_generate``: ``generated`` is ``[B, L + N]``, the log-probs
    ``[B, N, 1]`` and all <= 0, the log-ratio ``[B, N]``. Beyond TorchRL: each recorded
    log-prob equals a full-logit recomputation of the sampled token at the sampling temperature."""
    tok = make_tokenizer()
    rollout = make_rollout(tok, max_new_tokens=MAX_NEW)
    batch = prompt_batch(PROMPTS, COMPLETIONS, pad=tok.pad_token_id)
    generated, log_probs, log_ratio = rollout.generate(batch)
    size, width = batch.input_ids.shape
    assert generated.shape == (size, width + MAX_NEW)
    assert log_probs.shape == (size, MAX_NEW, 1) and bool((log_probs <= 0).all())
    assert log_ratio.shape == (size, MAX_NEW)
    for b, prompt in enumerate(PROMPTS):
        action = generated[b, len(prompt) : len(prompt) + MAX_NEW].tolist()
        n = action.index(EOS) + 1 if EOS in action else MAX_NEW
        row = generated[b, : len(prompt) + n]
        expected = token_log_probs(rollout.model, row, len(prompt), 0.7)
        torch.testing.assert_close(log_probs[b, :n, 0].double(), expected, rtol=0, atol=2e-5)


def test_rollout_from_data_keys_and_batch():
    """Ports ``TestRollout::test_rollout_from_data``: the seed's keys (step-wise ``input_ids`` /
    ``attention_mask`` with their ``"next"`` twins, ``action``, ``sample_log_prob``, ``("next",
    "reward" | "done" | "terminated")``) on a ``[B, N]`` batch. tether writes the step-wise
    views on request (``materialize_steps=True``); step ``t`` of a row sees its prompt and the
    first ``t`` actions, ``"next"`` one more, and the rewards add up: reward = raw + kl part."""
    tok = make_tokenizer()
    rollout = make_rollout(tok, max_new_tokens=MAX_NEW, materialize_steps=True)
    batch = prompt_batch(PROMPTS, COMPLETIONS, pad=tok.pad_token_id)
    td = rollout.rollout_from_data(batch)
    expected = {("next", "attention_mask"), ("next", "done"), ("next", "terminated"), ("next", "input_ids"),
                ("next", "reward"), "action", "attention_mask", "input_ids", "sample_log_prob"}
    assert expected <= set(td.keys(True, True))
    assert td.batch_size == (len(PROMPTS), MAX_NEW)
    b, t, start = 2, 1, len(PROMPTS[2])
    seen = td["input_ids"][b, t][td["attention_mask"][b, t].bool()].tolist()
    assert seen == PROMPTS[b] + td["action"][b, :t].tolist()
    seen_next = td["next", "input_ids"][b, t][td["next", "attention_mask"][b, t].bool()].tolist()
    assert seen_next == PROMPTS[b] + td["action"][b, : t + 1].tolist() and len(seen_next) == start + t + 1
    torch.testing.assert_close(td["next", "reward"], td["next", "reward_raw"] + td["next", "reward_kl"])


@pytest.mark.parametrize("use_max", [True, False], ids=["use_max", "gathered"])
def test_sample_log_prob_keeps_the_layout_of_the_scores(use_max):
    """Ports ``TestRollout::test_get_scores``: TorchRL's scores are ``[B, N]`` with
    ``use_max=True`` (the max over the vocabulary) and ``[B, N, 1]`` when gathered at the
    sampled tokens, and ``create_rollout_td`` stores them as given under ``sample_log_prob``.
    tether keeps either layout (it used to write ``[B, N, 1]`` for both). Values: the scores
    -1.5 on every step are kept up to each row's done step (DONE_INDEX) and 0 after it."""
    tok, rollout = build()
    batch = prompt_batch(STEP_PROMPTS, REFERENCE, pad=EOS)
    generated = generated_for(batch, ACTIONS, EOS)
    shape = (4, 4) if use_max else (4, 4, 1)
    td = rollout.create_rollout_td(batch, generated, torch.full(shape, -1.5), torch.zeros(4, 4))
    sample = td["sample_log_prob"]
    assert sample.shape == shape
    steps = torch.arange(4)[None, :] <= torch.tensor(DONE_INDEX)[:, None]
    expected = torch.where(steps, -1.5, 0.0)
    assert torch.equal(sample.reshape(4, 4), expected)
