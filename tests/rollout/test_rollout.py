"""RolloutFromModel on tiny models: every output value against an independent recomputation.

The recomputations share no code with the rollout: full logits of each unpadded row through
``log_softmax`` and ``gather`` (at the sampling temperature), the classifier's own pooled
score of each unpadded row, and Python scans for the first eos.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_tiny_model, make_tokenizer
from tests.rollout.builders import (
    EOS,
    end_score,
    eos_leaning_policy,
    prompt_batch,
    reward_model,
    token_log_probs,
)
from tether.rollout import RolloutFromModel

# Chat-like prompts: they contain the eos id (258) before the generation starts.
PROMPTS = [
    [257, 72, 105, 258, 10, 257, 97],
    [257, 120, 258, 257, 97, 98],
    [257, 50, 43, 50, 61, 258, 10, 257],
    [257, 200, 258],
    [257, 65, 66, 67, 68, 69, 258, 257, 97],
    [257, 9, 9],
]
COMPLETIONS = [[52, 258], [99, 100, 101, 258], [52], [33, 33, 258], [70, 258], [10, 11, 12]]


def make_rollout(tok, *, temperature=0.7, kl_coef=0.3, max_new_tokens=8, seed=1, **kwargs):
    policy = eos_leaning_policy(tok, p_eos=0.05)
    reference = make_tiny_model(tok, seed=1, dtype=torch.float64)
    return RolloutFromModel(
        policy,
        reference,
        reward_model(),
        kl_coef=kl_coef,
        max_new_tokens=max_new_tokens,
        score_clip=100.0,
        temperature=temperature,
        tokenizer=tok,
        generator=torch.Generator().manual_seed(seed),
        **kwargs,
    )


def first_eos(action_row: list[int]) -> int | None:
    for i, token in enumerate(action_row):
        if token == EOS:
            return i
    return None


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_rollout_values_match_independent_recomputation(pad_is_eos):
    """Done flags, sample log-probs, KL reward and score reward, row by row.

    Row b ends at its first sampled eos (index e, n = e + 1 tokens kept) or after N tokens.
    Expected: ``done`` only at n - 1; ``terminated`` iff an eos was sampled; sample log-prob
    and ``reward_kl = -kl_coef (log pi - log pi_ref)`` on the first n steps from full
    logits / 0.7 (0 after); ``reward_raw`` at n - 1 only, equal to
    ``clip(score(prompt + response) - score(prompt + reference completion), +-100)``.
    """
    tok = make_tokenizer(pad_is_eos=pad_is_eos)
    pad = tok.pad_token_id
    rollout = make_rollout(tok)
    batch = prompt_batch(PROMPTS, COMPLETIONS, pad=pad)
    td = rollout.rollout_from_data(batch)
    size, steps = len(PROMPTS), rollout.max_new_tokens
    assert td.batch_size == (size, steps) and td.names == [None, "time"]
    assert td["action"].dtype == torch.long and td["action"].shape == (size, steps)
    for key in ("reward", "reward_raw", "reward_kl"):
        assert td["next", key].dtype == torch.float32 and td["next", key].shape == (size, steps, 1)
    for key in ("done", "terminated", "truncated"):
        assert td["next", key].dtype == torch.bool and td["next", key].shape == (size, steps, 1)
    assert td["sample_log_prob"].dtype == torch.float32 and td["sample_log_prob"].shape == (size, steps, 1)

    ends = []
    for b in range(size):
        action = td["action"][b].tolist()
        eos_at = first_eos(action)
        n = steps if eos_at is None else eos_at + 1
        ends.append(eos_at)
        expected_done = torch.zeros(steps, dtype=torch.bool)
        expected_done[n - 1] = True
        assert torch.equal(td["next", "done"][b, :, 0], expected_done)
        assert torch.equal(td["next", "terminated"][b, :, 0], expected_done & (eos_at is not None))
        assert torch.equal(td["next", "truncated"][b, :, 0], expected_done & (eos_at is None))

        prompt = torch.tensor(PROMPTS[b])
        row = torch.cat([prompt, td["action"][b, :n]])
        start = len(PROMPTS[b])
        logp = token_log_probs(rollout.model, row, start, 0.7)
        ref_logp = token_log_probs(rollout.ref_model, row, start, 0.7)
        sample_lp = td["sample_log_prob"][b, :, 0].double()
        torch.testing.assert_close(sample_lp[:n], logp, rtol=0, atol=2e-5)
        assert torch.all(sample_lp[n:] == 0)
        reward_kl = td["next", "reward_kl"][b, :, 0].double()
        torch.testing.assert_close(reward_kl[:n], -0.3 * (logp - ref_logp), rtol=0, atol=2e-5)
        assert torch.all(reward_kl[n:] == 0)

        reference_row = torch.tensor(PROMPTS[b] + COMPLETIONS[b])
        diff = end_score(rollout.reward_model, row) - end_score(rollout.reward_model, reference_row)
        expected_raw = torch.zeros(steps, dtype=torch.float64)
        expected_raw[n - 1] = max(-100.0, min(100.0, diff))
        torch.testing.assert_close(td["next", "reward_raw"][b, :, 0].double(), expected_raw, rtol=0, atol=1e-5)
    torch.testing.assert_close(td["next", "reward"], td["next", "reward_raw"] + td["next", "reward_kl"])
    # The sampled batch exercises both endings, else the checks above prove less.
    assert any(e is None for e in ends) and any(e is not None and e < steps - 1 for e in ends)


def test_log_probs_use_the_sampling_temperature():
    """At T = 0.7 the recorded log-probs differ from the T = 1 ones by far more than float error."""
    tok = make_tokenizer()
    rollout = make_rollout(tok, temperature=0.7)
    batch = prompt_batch(PROMPTS, COMPLETIONS, pad=tok.pad_token_id)
    generation = rollout.generate(batch)
    b, n = 0, int(generation.response_mask[0].sum())
    row = generation.generated[b, : len(PROMPTS[b]) + n]
    at_one = token_log_probs(rollout.model, row, len(PROMPTS[b]), 1.0)
    at_sampling = token_log_probs(rollout.model, row, len(PROMPTS[b]), 0.7)
    recorded = generation.log_probs[b, :n, 0].double()
    torch.testing.assert_close(recorded, at_sampling, rtol=0, atol=2e-5)
    assert float((recorded - at_one).abs().max()) > 1e-2


def test_generate_unpacks_like_the_seed_and_sampling_agrees_with_scoring():
    """The triple unpacks; recorded (KV-cache) and recomputed (padding-free) log-probs agree."""
    tok = make_tokenizer()
    rollout = make_rollout(tok)
    batch = prompt_batch(PROMPTS, COMPLETIONS, pad=tok.pad_token_id)
    generation = rollout.generate(batch)
    generated, log_probs, log_ratio = generation
    assert generated is generation.generated and log_ratio is generation.log_ratio
    mask = generation.response_mask
    assert log_probs.shape == (*mask.shape, 1)  # the seed's [B, N, 1]; log_ratio stays [B, N]
    assert log_ratio.shape == mask.shape
    torch.testing.assert_close(log_probs[mask].squeeze(-1).double(), generation.policy_log_probs[mask].double(),
                               rtol=0, atol=2e-5)
    torch.testing.assert_close(
        log_ratio, (generation.policy_log_probs - generation.ref_log_probs).masked_fill(~mask, 0.0)
    )
    # generated: prompt, then the response at prompt_rindex, then pad.
    for b, prompt in enumerate(PROMPTS):
        n = int(mask[b].sum())
        assert generated[b, : len(prompt)].tolist() == prompt
        assert torch.all(generated[b, len(prompt) + n :] == tok.pad_token_id)
        assert generated.shape[1] == batch.input_ids.shape[1] + rollout.max_new_tokens


def test_reference_from_labels_equals_reference_inline():
    """The reference completion given through ``labels`` scores exactly as when it is inline."""
    tok = make_tokenizer()
    inline = make_rollout(tok, seed=5).rollout_from_data(prompt_batch(PROMPTS, COMPLETIONS, pad=259))
    labelled = make_rollout(tok, seed=5).rollout_from_data(
        prompt_batch(PROMPTS, COMPLETIONS, pad=259, with_labels=True)
    )
    assert torch.equal(inline["action"], labelled["action"])
    torch.testing.assert_close(inline["next", "reward_raw"], labelled["next", "reward_raw"], rtol=0, atol=1e-6)
    assert bool((inline["next", "reward_raw"] != 0).any())


def test_rollout_is_reproducible_with_a_generator():
    tok = make_tokenizer()
    batch = prompt_batch(PROMPTS, COMPLETIONS, pad=259)
    first = make_rollout(tok, seed=11).rollout_from_data(batch)
    second = make_rollout(tok, seed=11).rollout_from_data(batch)
    other = make_rollout(tok, seed=12).rollout_from_data(batch)
    assert torch.equal(first["action"], second["action"])
    assert not torch.equal(first["action"], other["action"])
