"""The KL history and ``step_scheduler``: per-sequence summed KLs in, a new ``kl_coef`` out."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_tiny_model, make_tokenizer
from tests.rollout.builders import EOS, eos_leaning_policy, prompt_batch, reward_model, token_log_probs
from tests.rollout.test_rollout import COMPLETIONS, PROMPTS
from tether.control import AdaptiveKLController, ConstantKLController
from tether.rollout import RolloutFromModel


def make(tok, *, num_steps=None, seed=3):
    return RolloutFromModel(
        eos_leaning_policy(tok, p_eos=0.05),
        make_tiny_model(tok, seed=1, dtype=torch.float64),
        reward_model(),
        kl_coef=0.2,
        max_new_tokens=6,
        num_steps=num_steps,
        temperature=0.9,
        tokenizer=tok,
        generator=torch.Generator().manual_seed(seed),
    )


def summed_kl(rollout, td) -> list[float]:
    """Per-sequence sum of log pi - log pi_ref over the kept response tokens, from full logits."""
    out = []
    for b, prompt in enumerate(PROMPTS):
        action = td["action"][b].tolist()
        n = action.index(EOS) + 1 if EOS in action else len(action)
        row = torch.tensor(prompt + action[:n])
        diff = token_log_probs(rollout.model, row, len(prompt), 0.9) - token_log_probs(
            rollout.ref_model, row, len(prompt), 0.9
        )
        out.append(float(diff.sum()))
    return out


def test_adaptive_update_uses_mean_per_sequence_summed_kl_over_all_queued_sequences():
    """Hand-check of one update.

    Two rollouts of 6 prompts queue 12 per-sequence KLs with mean m (recomputed here from
    full logits). With target = m / 0.9 the error is e = 0.9 - 1 = -0.1 (inside the clip),
    n_steps = 12 sequences and horizon = 60, so beta = 0.2 * (1 - 0.1 * 12 / 60) = 0.196.
    The seed's unit (mean over the padded [B, N] grid of the per-token KL) would give
    another error, checked to differ.
    """
    tok = make_tokenizer()
    rollout = make(tok)
    first = rollout.rollout_from_data(prompt_batch(PROMPTS, COMPLETIONS, pad=259))
    second = rollout.rollout_from_data(prompt_batch(PROMPTS, COMPLETIONS, pad=259))
    kls = torch.tensor(summed_kl(rollout, first) + summed_kl(rollout, second), dtype=torch.float64)
    torch.testing.assert_close(rollout.queued_kl, kls, rtol=0, atol=1e-4)
    mean = float(kls.mean())
    assert mean > 0
    rollout.kl_scheduler = AdaptiveKLController(init_kl_coef=0.2, target=mean / 0.9, horizon=60, model=rollout)
    assert rollout.step_scheduler() == pytest.approx(0.196, abs=1e-6)
    assert rollout.kl_coef == pytest.approx(0.196, abs=1e-6) and isinstance(rollout.kl_coef, float)
    assert rollout.queued_kl.numel() == 0
    per_token_grid = -torch.cat([first["next", "reward_kl"], second["next", "reward_kl"]]).mean() / 0.2
    assert abs(float(per_token_grid) / (mean / 0.9) - 0.9) > 0.05
    # The next rollout pays the new coefficient.
    third = rollout.rollout_from_data(prompt_batch(PROMPTS, COMPLETIONS, pad=259))
    expected = -0.196 * torch.tensor(summed_kl(rollout, third), dtype=torch.float64)
    torch.testing.assert_close(third["next", "reward_kl"].sum((1, 2)).double(), expected, rtol=0, atol=2e-5)


def test_num_steps_keeps_only_the_latest_rollouts():
    tok = make_tokenizer()
    rollout = make(tok, num_steps=1)
    rollout.rollout_from_data(prompt_batch(PROMPTS, COMPLETIONS, pad=259))
    last = rollout.rollout_from_data(prompt_batch(PROMPTS, COMPLETIONS, pad=259))
    torch.testing.assert_close(rollout.queued_kl, torch.tensor(summed_kl(rollout, last), dtype=torch.float64),
                               rtol=0, atol=1e-4)


def test_constant_controller_resets_the_coefficient_and_clears_the_queue():
    tok = make_tokenizer()
    rollout = make(tok)
    rollout.kl_scheduler = ConstantKLController(kl_coef=0.05)
    rollout.rollout_from_data(prompt_batch(PROMPTS, COMPLETIONS, pad=259))
    assert rollout.step_scheduler() == 0.05 and rollout.kl_coef == 0.05
    assert rollout.queued_kl.numel() == 0
    with pytest.raises(ValueError, match="step_scheduler: no KL recorded"):
        rollout.step_scheduler()


def test_step_scheduler_without_a_scheduler_is_an_error():
    tok = make_tokenizer()
    rollout = make(tok)
    rollout.rollout_from_data(prompt_batch(PROMPTS, COMPLETIONS, pad=259))
    with pytest.raises(ValueError, match="kl_scheduler"):
        rollout.step_scheduler()
