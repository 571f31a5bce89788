"""Property tests: finite inputs in each documented range give finite outputs and gradients.

Ranges (float32 unless said): logits in [-1e4, 1e4] with any entries but not all at
-inf, temperature in [0.05, 20]; log-probs in [-80, 0] for k3 and its loss term (beyond
``d = ref - logp ~ 88.7`` the exact value exceeds float32); log-ratios in [-20, 20] for the
clipped surrogate; every finite value for ESS, ``aggregate``'s means and ``grpo``
advantages; |reward| <= 2^99 (~6e29) for reward-to-go and the other advantage modes. Shapes are
small and example counts modest so the file runs in seconds on one core.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether import ops

F32 = torch.float32
FAST = settings(max_examples=25, deadline=None)
FINITE32 = {"allow_nan": False, "allow_infinity": False, "width": 32}


@st.composite
def tensors(draw, shape, low=None, high=None, dtype=F32):
    """A tensor of ``shape`` with finite entries in [low, high] (all finite when None)."""
    n = 1
    for size in shape:
        n *= size
    values = draw(st.lists(st.floats(low, high, **FINITE32), min_size=n, max_size=n))
    return torch.tensor(values, dtype=dtype).reshape(shape)


@st.composite
def masks(draw, shape):
    n = shape[0] * shape[1]
    return torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(shape)


def _finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


SHAPE = st.tuples(st.integers(1, 3), st.integers(1, 4))


@st.composite
def logits_batch(draw):
    """``[B, T, V]`` logits in [-1e4, 1e4], some entries -inf but never a whole row."""
    b, t = draw(SHAPE)
    v = draw(st.integers(2, 6))
    logits = draw(tensors((b, t, v), -1e4, 1e4))
    hole = draw(masks((b * t, v))).reshape(b, t, v)
    hole[..., 0] = False
    labels = torch.tensor(draw(st.lists(st.integers(0, v - 1), min_size=b * t, max_size=b * t))).reshape(b, t)
    # Labels must point at a finite logit, or their log-prob is -inf by definition.
    hole.scatter_(-1, labels[..., None], False)
    return logits.masked_fill(hole, float("-inf")), labels


@FAST
@given(logits_batch(), logits_batch(), st.floats(0.05, 20))
def test_vocabulary_reductions_finite(batch, ref_batch, temperature):
    logits, labels = batch
    ref = ref_batch[0]
    if ref.shape != logits.shape:
        ref = torch.zeros_like(logits)
    logits.requires_grad_(True)
    logp = ops.token_logprobs(logits, labels, temperature=temperature)
    entropy = ops.token_entropy(logits, temperature=temperature)
    kl = ops.exact_kl(logits, ref.masked_fill(torch.isneginf(ref), -1e4), temperature=temperature)
    (grad,) = torch.autograd.grad((logp + entropy + kl).sum(), logits)
    assert _finite(logp, entropy, kl)
    assert torch.isfinite(grad[~torch.isneginf(logits)]).all()
    assert (logp <= 0).all() and (entropy >= -1e-5).all() and (kl >= -1e-5).all()


@FAST
@given(SHAPE.flatmap(lambda s: st.tuples(tensors(s, -80, 0), tensors(s, -80, 0), tensors(s, -80, 0))))
def test_kl_estimators_and_loss_terms_finite(triple):
    logp, ref, old = (t.clone() for t in triple)
    logp.requires_grad_(True)
    for name in ops.KL_ESTIMATORS:
        assert _finite(ops.kl_estimate(logp.detach(), ref, name))
    for estimator in ("k2", "k3"):
        for old_logp in (None, old):
            term = ops.kl_loss_term(logp, ref, estimator=estimator, old_logp=old_logp)
            (grad,) = torch.autograd.grad(term.sum(), logp)
            assert _finite(term, grad)


MODES = st.sampled_from(list(ops.AGGREGATION_MODES))


@FAST
@given(SHAPE.flatmap(lambda s: st.tuples(tensors(s), masks(s))), MODES)
def test_aggregate_means_finite_for_every_finite_value(pair, mode):
    values, mask = pair
    if "token-sum" in mode:
        values = values.clamp(-1e30, 1e30)  # sums of 4 such values stay below float32 max
    kwargs = {"normalizer": 4.0} if mode.endswith("norm") else {}
    result = ops.aggregate(values.requires_grad_(True), mask, mode, **kwargs)
    (grad,) = torch.autograd.grad(result, values)
    assert _finite(result, grad)
    kept = values.detach()[mask]
    if mode == "token-mean" and kept.numel():
        assert kept.min() <= result <= kept.max()


@FAST
@given(st.integers(1, 3).flatmap(lambda g: tensors((2, g))), st.sampled_from(list(ops.ADVANTAGE_MODES)))
def test_group_advantages_finite(rewards, mode):
    if mode != "grpo":
        rewards = rewards.clamp(-1e30, 1e30)
    if mode == "rloo" and rewards.shape[1] < 2:
        rewards = torch.cat([rewards, rewards], dim=1)
    result = ops.group_advantages(rewards, mode=mode)
    assert _finite(result)
    if mode == "grpo":
        assert (result.abs() <= rewards.shape[1]).all()  # |z| <= (G - 1) / sqrt(G) < G


@FAST
@given(SHAPE.flatmap(lambda s: st.tuples(tensors(s, -2.0**99, 2.0**99), masks(s))), st.floats(0, 1))
def test_reward_to_go_finite(pair, gamma):
    rewards, mask = pair
    assert _finite(ops.reward_to_go(rewards, mask, gamma=gamma))


@FAST
@given(SHAPE.flatmap(lambda s: st.tuples(tensors(s, -20, 20), tensors((s[0], 1), -1e3, 1e3), masks(s))),
       st.sampled_from([None, 3.0]))
def test_policy_losses_finite(triple, dual_clip):
    log_ratio, advantages, mask = triple
    log_ratio.requires_grad_(True)
    out = ops.clipped_surrogate(log_ratio, advantages, clip_epsilon=(0.2, 0.28), dual_clip=dual_clip)
    gspo = ops.gspo_log_ratio(log_ratio, torch.zeros_like(log_ratio), mask)
    (grad,) = torch.autograd.grad(out.loss.sum() + gspo.sum(), log_ratio)
    assert _finite(out.loss, out.ratio, gspo, grad)
    for mode in ops.IMPORTANCE_WEIGHT_MODES:
        weights = ops.importance_weights(log_ratio, torch.zeros_like(log_ratio), mask, mode=mode)
        assert _finite(weights) and (weights >= 0).all() and (weights <= 2.0).all()


@FAST
@given(SHAPE.flatmap(lambda s: st.tuples(tensors(s), masks(s))))
def test_effective_sample_size_in_one_to_n_for_every_finite_log_weight(pair):
    log_weights, mask = pair
    ess = ops.effective_sample_size(log_weights, mask)
    n = int(mask.sum())
    assert torch.isfinite(ess)
    assert (ess == 0) if n == 0 else (1 - 1e-5 <= ess.item() <= n * (1 + 1e-5))


@FAST
@given(st.integers(0, 6).flatmap(lambda t: st.tuples(
    st.just(t), st.lists(st.integers(0, t), min_size=1, max_size=4), st.sampled_from(["left", "right"]))))
def test_masks_count_their_lengths(case):
    total, lengths, side = case
    lengths = torch.tensor(lengths)
    prompts = lengths // 2
    mask = ops.mask_from_lengths(lengths, total, padding_side=side)
    response = ops.response_mask(prompts, lengths, total, padding_side=side)
    assert mask.sum(-1).tolist() == lengths.tolist()
    assert response.sum(-1).tolist() == (lengths - prompts).tolist()
    assert not (response & ~mask).any()
