"""The recipe's loss (``recipe.token_terms`` + ``recipe.reduce``, written from ``tether.ops``)
equals the library's ``GRPOLoss`` built with the same options: loss, every diagnostic and every
parameter gradient to 1e-12 in float64, over the loss options ``TrainConfig`` offers.

The batch is off-policy on purpose (sampling log-probs shifted inside the answers, advantages of
both signs, stored old log-probs apart from the sampler's) and the policy is moved off the
reference, so the ratios differ from 1, the clips act, the importance weights are not 1, the KL
terms and their gradients are not 0, and ESS < 1.
"""

from __future__ import annotations

import pytest
import torch

from tests.train.test_recipe import prepared, tiny_cfg
from tether.models.score_plan import row_slices
from tether.objectives import GRPOLoss, GRPOTokenTerms
from tether.ops import aggregate_denominator
from tether.train import recipe
from tether.train.config import TrainConfig
from tether.train.recipe import build_run

OUTPUTS = ("loss_objective", "loss_entropy", "loss_kl_to_ref", "clip_fraction", "kl_approx", "ESS", "entropy",
           "kl_to_ref", "kl_to_ref_exact")


def library_loss(cfg: TrainConfig, actor) -> GRPOLoss:
    """``GRPOLoss`` with ``cfg``'s loss options: the reference the recipe's loss is held to."""
    in_loss = cfg.kl_mode == "loss"
    return GRPOLoss(
        actor, clip_epsilon=(cfg.clip_epsilon, cfg.clip_epsilon_high) if cfg.clip_epsilon_high else cfg.clip_epsilon,
        entropy_bonus=True, entropy_coeff=cfg.entropy_coeff, aggregation=cfg.aggregation,
        kl_estimator=cfg.kl_estimator if in_loss else "k3", kl_to_ref_coeff=cfg.kl_coef if in_loss else None,
        kl_correction=None if cfg.kl_correction == "none" else "importance",
        normalizer=cfg.max_new_tokens if cfg.aggregation == "seq-mean-token-sum-norm" else None,
        ratio_level=cfg.ratio_level, dual_clip=cfg.dual_clip or None, importance_cap=cfg.importance_cap,
        trust_region=cfg.trust_region,
        trust_region_delta=(cfg.trust_region_delta, cfg.trust_region_delta_high or cfg.trust_region_delta),
        importance_correction=None if cfg.importance_correction == "none" else cfg.importance_correction,
    )


def off_policy(record, *, old: bool):
    """``record`` with sampling log-probs shifted by up to +-0.6 inside the answers, advantages of
    both signs, and (``old``) trainer log-probs under the sampling weights 0.3 apart from them."""
    mask = record.assistant_mask
    offset = torch.linspace(-0.6, 0.6, mask.numel(), dtype=torch.float64).reshape(mask.shape) * mask
    record.sample_log_probs = record.sample_log_probs + offset
    signs = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)[:, None]
    record.advantages = signs.expand_as(mask) * mask
    if old:
        record.old_log_probs = record.sample_log_probs - 0.3 * offset.flip(-1) * mask
    return record


def away_from_the_reference(run) -> None:
    """Move the policy off the reference (a separate copy), so the KL terms and their gradients are not 0."""
    draw = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in run.models.policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=draw, dtype=p.dtype))


def _gradients(run) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in run.models.policy.named_parameters() if p.grad is not None}


CASES = [
    {"micro_batch_size": 6},  # the defaults in one pass: token-mean, k3 in the loss, clip 0.2, exact KL measured in the pass
    {"clip_epsilon": 0.99, "clip_epsilon_high": 50.0},  # a clip that never acts
    {"clip_epsilon": 0.1, "clip_epsilon_high": 0.3, "dual_clip": 1.2, "entropy_coeff": 0.01},
    {"kl_estimator": "k2", "aggregation": "seq-mean-token-mean", "kl_signal": "sampled", "kl_control_signal": "sampled"},
    {"aggregation": "seq-mean-token-sum", "kl_coef": 0.3, "micro_batch_size": 1},
    {"aggregation": "seq-mean-token-sum-norm", "ratio_level": "sequence"},
    {"kl_mode": "reward", "kl_estimator": "k1", "kl_coef": 0.2},
    {"importance_correction": "tis", "importance_cap": 1.2, "kl_estimator": "k2"},
    {"importance_correction": "mis", "importance_cap": 1.2, "ratio_level": "sequence", "entropy_coeff": 0.05},
    {"trust_region": "dppo_tv", "trust_region_delta": 0.002},  # DPPO's masks at thresholds that cut some tokens
    {"trust_region": "dppo_kl", "trust_region_delta": 1e-5, "trust_region_delta_high": 1e-4, "dual_clip": 1.5},
    {"trust_region": "none", "importance_correction": "tis", "importance_cap": 1.2},
    {"kl_correction": "none"},  # the raw k3 (GRPO paper) as the loss term
    {"kl_correction": "none", "kl_estimator": "k2", "importance_correction": "mis", "importance_cap": 1.2},
]
# Under TIS/MIS the ratio is against the trainer's stored old log-probs, when there are some.
CASES += [{**options, "stored_old": True} for options in CASES if "importance_correction" in options]


@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_recipe_loss_equals_grpo_loss(tmp_path, options):
    options = dict(options)
    stored_old = options.pop("stored_old", False)
    run = build_run(tiny_cfg(tmp_path / "run", dtype="float64", **{"micro_batch_size": 4, **options}))
    away_from_the_reference(run)
    record = off_policy(prepared(run)[0], old=stored_old)
    assert record.tokens.shape[0] == 6 and record.sample_log_probs.dtype == torch.float64
    # The recipe's training path (micro-batches against the whole batch's denominator) and the same
    # accumulation through GRPOLoss: the same micro-batches score with the same rounding (another cut
    # of the rows moves the gradients by ~1e-8: the shared-prefix split and HF's float32 RMSNorm).
    kept = recipe.accumulate_gradients(run, record)
    ours, our_grads = recipe.reduce(run, kept), _gradients(run)
    library = library_loss(run.cfg, run.actor)
    denominator = aggregate_denominator(record.assistant_mask, library.aggregation)
    run.optimizer.zero_grad(set_to_none=True)
    parts = []
    for begin, end in row_slices(len(record), run.cfg.micro_batch_size):
        parts.append(library.token_terms(record.rows(begin, end)))
        library.reduce(parts[-1], denominator=denominator).total_loss().backward()
    theirs, their_grads = library.reduce(GRPOTokenTerms.cat([t.detach() for t in parts])), _gradients(run)
    for name in OUTPUTS:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    torch.testing.assert_close(ours.total_loss(), theirs.total_loss(), rtol=1e-12, atol=1e-12)
    assert our_grads.keys() == their_grads.keys() and our_grads
    scale = max(float(g.abs().max()) for g in their_grads.values())
    assert scale > 1e-6  # a gradient that could differ
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-12, atol=1e-12 * scale, msg=lambda m: f"{name}: {m}")
    # The batch is what the docstring says, so each option had something to act on.
    # (under TIS/MIS without stored old log-probs the ratio is against the current policy: 1, never clipped)
    on_policy_ratio = options.get("importance_correction", "none") != "none" and not stored_old
    clip_acts = float(theirs.clip_fraction) > 0
    region = options.get("trust_region", "clip")
    expected = region != "none" and options.get("clip_epsilon_high") != 50.0 and not (on_policy_ratio and region == "clip")
    assert clip_acts == expected, float(theirs.clip_fraction)
    assert region == "clip" or float(theirs.clip_fraction) < 0.9  # DPPO's masks cut some tokens, not all
    assert float(theirs.ESS) < 0.99
    assert (theirs.kl_to_ref_exact is not None) == (run.cfg.kl_signal == "exact")
    assert theirs.kl_to_ref_exact is None or float(theirs.kl_to_ref_exact) > 1e-3
    assert (theirs.loss_kl_to_ref is not None) == (run.cfg.kl_mode == "loss")
    assert theirs.loss_kl_to_ref is None or abs(float(theirs.loss_kl_to_ref)) > 1e-4


def test_micro_batches_with_the_whole_denominator_add_up_to_the_batch(tmp_path):
    """``reduce`` with the whole batch's denominator on each micro-batch sums to the whole
    batch's loss (seq-mean-token-sum: the outer count is the batch's rows, 6, not 4 or 2)."""
    run = build_run(tiny_cfg(tmp_path / "run", dtype="float64", aggregation="seq-mean-token-sum"))
    record = off_policy(prepared(run)[0], old=False)
    denominator = aggregate_denominator(record.assistant_mask, "seq-mean-token-sum")
    assert int(denominator) == 6
    with torch.no_grad():
        whole = recipe.reduce(run, recipe.token_terms(run, record)).total_loss()
        parts = [recipe.reduce(run, recipe.token_terms(run, record.rows(b, e)), denominator).total_loss()
                 for b, e in ((0, 4), (4, 6))]
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-12, atol=1e-12)
    assert abs(float(parts[0]) - float(whole)) > 1e-6  # each part alone is not the whole
