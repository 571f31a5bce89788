"""``kl_mode=exact``: the exact full-vocabulary KL per answer token is the leash's loss term.

Its value is ``kl_coef x token-mean`` of the exact KL the loss pass measures, and its gradient is
that of a naive reference: each row's valid tokens run alone through the policy and the
reference (positions from 0, as the padding-free scorer places them), ``log_softmax`` over the
whole vocabulary, ``sum_v p_v (log p_v - log q_v)`` at the positions predicting the answer
tokens, the reference a constant, the same token-mean and coefficient. Float64, tiny model; the gradients
agree to 1e-7 of the largest (one row at a time against the scorer's packed rows moves them by
~1e-10 absolute, as in tests/train/test_recipe_loss.py: HF's float32 RMSNorm), the value to 1e-9.
"""

from __future__ import annotations

import pytest
import torch

from tests.train.test_recipe import prepared, tiny_cfg
from tests.train.test_recipe_loss import away_from_the_reference
from tether.train import recipe
from tether.train.config import TrainConfig
from tether.train.recipe import build_run


def _naive_leash(run, record, coef: float) -> torch.Tensor:
    policy, reference = run.models.policy, run.ref_scorer.model
    mask = record.assistant_mask & record.attention_mask
    total, count = torch.zeros((), dtype=torch.float64), int(mask.sum())
    for row in range(record.tokens.shape[0]):
        valid = record.attention_mask[row]
        ids = record.tokens[row][valid][None]
        answer = mask[row][valid]
        logp = torch.log_softmax(policy(input_ids=ids).logits[0].double() / run.cfg.temperature, -1)
        with torch.no_grad():
            logq = torch.log_softmax(reference(input_ids=ids).logits[0].double() / run.cfg.temperature, -1)
        per_position = (logp.exp() * (logp - logq)).sum(-1)  # position t predicts token t + 1
        total = total + per_position[:-1][answer[1:]].sum()
    return coef * total / count


def test_exact_kl_loss_value_and_gradient_match_a_naive_reference(tmp_path):
    run = build_run(tiny_cfg(tmp_path / "run", dtype="float64", kl_mode="exact", kl_coef=0.3,
                             kl_controller="constant", micro_batch_size=6))
    away_from_the_reference(run)
    record = prepared(run)[0]
    params = [p for p in run.models.policy.parameters() if p.requires_grad]
    out = recipe.reduce(run, recipe.token_terms(run, record))
    ours = torch.autograd.grad(out.loss_kl_to_ref, params, allow_unused=True)
    assert float(out.kl_to_ref_exact) > 1e-3
    torch.testing.assert_close(out.loss_kl_to_ref, 0.3 * out.kl_to_ref_exact, rtol=1e-12, atol=0)
    torch.testing.assert_close(out.kl_to_ref, out.kl_to_ref_exact, rtol=0, atol=0)
    naive = _naive_leash(run, record, 0.3)
    torch.testing.assert_close(out.loss_kl_to_ref, naive, rtol=1e-9, atol=0)
    theirs = torch.autograd.grad(naive, params, allow_unused=True)
    scale = max(float(g.abs().max()) for g in theirs if g is not None)
    assert scale > 1e-6
    for a, b in zip(ours, theirs):
        if b is None:
            assert a is None or float(a.abs().max()) == 0.0
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7 * scale)


def test_exact_mode_needs_the_exact_signal(tmp_path):
    with pytest.raises(ValueError, match="kl_mode: 'exact' needs kl_signal='exact'"):
        tiny_cfg(tmp_path / "run", kl_mode="exact", kl_signal="sampled", kl_control_signal="sampled").validate()
    assert TrainConfig(kl_mode="exact").validate().kl_signal == "exact"
