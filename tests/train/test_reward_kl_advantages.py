"""``kl_mode=reward`` adds the KL penalty's reward-to-go AFTER the group normalisation of the
outcome rewards, so the penalty is neither divided by the group's spread nor cancelled by its mean.

Hand derivation, one group of two answers, rewards ``[1, 0]``, ``beta = 0.1``, k1 terms
``log pi_sampler - log pi_ref`` of row 0 ``[0.2, -0.1, 0.3]`` and of row 1 ``[0.4, 0.1]``:

* outcome advantages (grpo, Bessel spread ``sqrt(0.5)``, eps 1e-6): ``+-a``, ``a = 0.5 / (sqrt(0.5) + 1e-6)``;
* penalties ``-beta k1``: row 0 ``[-0.02, 0.01, -0.03]``, row 1 ``[-0.04, -0.01]``; their
  reward-to-go: row 0 ``[-0.04, -0.02, -0.03]``, row 1 ``[-0.05, -0.01]``;
* advantages: row 0 ``a + [-0.04, -0.02, -0.03]``, row 1 ``-a + [-0.05, -0.01]``.

Normalising the KL with the group (totals ``[0.96, -0.05]``) would give ``+-0.70711`` at the first
tokens instead: the 0.01 difference of the two answers' KL would vanish into the mean and the spread.
"""

from __future__ import annotations

import math

import torch

from tests.train.test_recipe import tiny_cfg
from tether.models.records import StepRecord
from tether.train.recipe import add_advantages, build_run

F64 = torch.float64


def _record() -> StepRecord:
    mask = torch.tensor([[False, False, True, True, True], [False, False, True, True, False]])
    ref = torch.full((2, 5), -2.0, dtype=F64)
    k1 = torch.tensor([[0.0, 0.0, 0.2, -0.1, 0.3], [0.0, 0.0, 0.4, 0.1, 0.0]], dtype=F64)
    return StepRecord(tokens=torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5, dtype=torch.bool),
                      assistant_mask=mask, group_ids=torch.tensor([0, 0]), sample_log_probs=ref + k1,
                      ref_log_probs=ref, rewards=torch.tensor([1.0, 0.0], dtype=F64))


def test_reward_kl_enters_after_the_group_normalisation(tmp_path):
    run = build_run(tiny_cfg(tmp_path / "run", kl_mode="reward", kl_estimator="k1", kl_coef=0.1,
                             kl_controller="constant", dtype="float64"))
    assert float(run.leash.kl_coef) == 0.1
    record = _record()
    add_advantages(run, record)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = torch.tensor([[0.0, 0.0, a - 0.04, a - 0.02, a - 0.03], [0.0, 0.0, -a - 0.05, -a - 0.01, 0.0]], dtype=F64)
    torch.testing.assert_close(record.advantages.to(F64), expected, rtol=0, atol=1e-12)


def test_loss_mode_leaves_the_outcome_advantage_alone(tmp_path):
    """With the leash in the loss the advantage is the normalised outcome alone, on every answer token."""
    run = build_run(tiny_cfg(tmp_path / "run", kl_mode="loss", kl_coef=0.1, kl_controller="constant", dtype="float64"))
    record = _record()
    add_advantages(run, record)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = torch.tensor([[0.0, 0.0, a, a, a], [0.0, 0.0, -a, -a, 0.0]], dtype=F64)
    torch.testing.assert_close(record.advantages.to(F64), expected, rtol=0, atol=1e-12)
