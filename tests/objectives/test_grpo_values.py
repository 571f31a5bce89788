"""GRPOLoss values derived by hand on tiny float64 batches with controlled log-ratios.

Every batch comes from ``make_batch``: the actor's own log-probs are computed first and the
sampling log-probs are set to ``current - delta``, so the ratio of each response token is
exactly ``exp(delta)``. The grid (``two_row_grid``) has 2 response tokens in row 0 and 3 in
row 1 (row 1 is left-padded), so the aggregation modes give different numbers.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tether.objectives import GRPOLoss
from tests.objectives.helpers import F64, make_batch, place, scored, tiny_wrapper, two_row_grid

LOG = math.log
ADV = torch.tensor([1.0, -2.0])


def close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


@pytest.fixture(scope="module")
def actor():
    return tiny_wrapper()


def grid_batch(actor, delta_rows, advantage=ADV, rho_rows=None, outside=float("nan")):
    tokens, attention, loss_mask = two_row_grid()
    rho = None if rho_rows is None else place(rho_rows, loss_mask)
    return make_batch(
        actor, tokens, attention, loss_mask, advantage, delta=place(delta_rows, loss_mask), rho=rho, outside=outside
    )


BASE_DELTA = [[LOG(1.5), LOG(0.9)], [LOG(0.5), LOG(1.1), 0.0]]


@pytest.mark.parametrize(
    "mode, normalizer, expected",
    [
        ("token-mean", None, 3.7 / 5),
        ("seq-mean-token-mean", None, (-2.1 / 2 + 5.8 / 3) / 2),
        ("seq-mean-token-sum", None, (-2.1 + 5.8) / 2),
        ("seq-mean-token-sum-norm", 4.0, (-2.1 / 4 + 5.8 / 4) / 2),
    ],
)
def test_clipped_and_unclipped_tokens_in_each_mode(actor, mode, normalizer, expected):
    """eps = 0.2, ratios row 0 (A = +1): 1.5 -> clipped at 1.2, loss -1.2; 0.9 -> -0.9.
    Row 1 (A = -2): 0.5 -> below 0.8 with A < 0, clipped: -0.8 * -2 = 1.6; 1.1 -> 2.2; 1 -> 2.0.
    Row sums -2.1 (2 tokens) and 5.8 (3 tokens). Clipped tokens: 2 of 5. kl_approx is the
    mean of -delta = -log(1.5 * 0.9 * 0.5 * 1.1) / 5. ESS over the weights
    [1.5, 0.9, 0.5, 1.1, 1]: 5^2 / 5.52, divided by the 5 tokens."""
    loss = GRPOLoss(actor, aggregation=mode, normalizer=normalizer)
    out = loss(grid_batch(actor, BASE_DELTA))
    close(out.loss_objective, expected)
    close(out.clip_fraction, 0.4)
    close(out.kl_approx, -LOG(1.5 * 0.9 * 0.5 * 1.1) / 5)
    close(out.ESS, 25 / 5.52 / 5)


@pytest.mark.parametrize(
    "clip_epsilon, expected_loss",
    [
        # 1.25 > 1.2 clipped (-1.2); 0.85 inside [0.8, 1.2] -> 0.85 * 2 = 1.7.
        (0.2, (-1.2 - 0.9 + 1.7 + 2.2 + 2.0) / 5),
        # high 0.28: 1.25 inside -> -1.25; low 0.1: 0.85 < 0.9 with A < 0 -> clipped, 1.8.
        ((0.1, 0.28), (-1.25 - 0.9 + 1.8 + 2.2 + 2.0) / 5),
    ],
)
def test_clip_higher(actor, clip_epsilon, expected_loss):
    """Ratios [1.25, 0.9] (A = +1) and [0.85, 1.1, 1] (A = -2): the asymmetric clip moves the
    upper bound for positive advantages and the lower one for negative advantages. One
    token of five is clipped in each case (a different one)."""
    batch = grid_batch(actor, [[LOG(1.25), LOG(0.9)], [LOG(0.85), LOG(1.1), 0.0]])
    out = GRPOLoss(actor, clip_epsilon=clip_epsilon)(batch)
    close(out.loss_objective, expected_loss)
    close(out.clip_fraction, 0.2)


@pytest.mark.parametrize("dual_clip, expected_loss, expected_clip", [(None, 11.6 / 5, 0.2), (3.0, 9.6 / 5, 0.4)])
def test_dual_clip(actor, dual_clip, expected_loss, expected_clip):
    """Row 0 (A = +1) on-policy: -1, -1. Row 1 (A = -2), ratios 4, 2, 0.5: without a dual clip
    8, 4 and the clipped 1.6 (sum 11.6 with row 0); with c = 3 the ratio 4 > 3 is capped at
    -c A = 6 and counted as clipped (sum 9.6)."""
    batch = grid_batch(actor, [[0.0, 0.0], [LOG(4.0), LOG(2.0), LOG(0.5)]])
    out = GRPOLoss(actor, dual_clip=dual_clip)(batch)
    close(out.loss_objective, expected_loss)
    close(out.clip_fraction, expected_clip)


def test_gspo_sequence_ratio(actor):
    """GSPO: each token of a row gets its row's ratio exp(mean delta).
    Row 0: s0 = (1.5 * 0.9)^(1/2) = 1.1619, inside the clip, loss -s0 on both tokens.
    Row 1: s1 = (0.5 * 1.1 * 1)^(1/3) = 0.8193 > 0.8, loss 2 s1 on its three tokens.
    Token mean (2 (-s0) + 3 (2 s1)) / 5; nothing clipped. With row 0 ratios [1.5, 1.3]
    (s0 = 1.3964 > 1.2) both of its tokens are clipped at -1.2."""
    s0, s1 = math.sqrt(1.5 * 0.9), (0.5 * 1.1) ** (1 / 3)
    loss = GRPOLoss(actor, ratio_level="sequence")
    out = loss(grid_batch(actor, BASE_DELTA))
    close(out.loss_objective, (2 * -s0 + 3 * 2 * s1) / 5)
    close(out.clip_fraction, 0.0)
    out = loss(grid_batch(actor, [[LOG(1.5), LOG(1.3)], [LOG(0.5), LOG(1.1), 0.0]]))
    close(out.loss_objective, (2 * -1.2 + 3 * 2 * s1) / 5)
    close(out.clip_fraction, 0.4)


def one_row_batch(actor, delta_old, mu, with_old=True):
    """One row, response at cols 4-5: old = cur - delta_old, sampled = old - mu."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 250, (1, 6), generator=gen)
    attention = torch.ones(1, 6, dtype=torch.bool)
    loss_mask = torch.zeros(1, 6, dtype=torch.bool)
    loss_mask[0, 4:] = True
    delta_old, mu = place([delta_old], loss_mask), place([mu], loss_mask)
    td = make_batch(actor, tokens, attention, loss_mask, torch.tensor([1.0]), delta=delta_old + mu)
    if with_old:
        td["old_log_probs", "full"] = scored(actor, tokens, attention).log_probs - delta_old
    return td


@pytest.mark.parametrize(
    "mode, with_old, expected",
    [
        # ratios [1.1, 1] (vs old), weights min([3, 0.5], 2) = [2, 0.5]: (-2.2 - 0.5) / 2.
        ("tis", True, -1.35),
        # masked: 3 > 2 is dropped: (0 - 0.5) / 2.
        ("mis", True, -0.25),
        # no old log-probs: ratio 1, weights min(pi / pi_sampler, 2) = [2, 0.5].
        ("tis", False, (-2.0 - 0.5) / 2),
    ],
)
def test_sampler_mismatch_weights(actor, mode, with_old, expected):
    """A = +1, trainer-old vs current log-ratio delta_old = [log 1.1, 0], sampler vs old
    mu = [log 3, log 0.5]. With old log-probs the ratio is against them and each token is
    weighted by the truncated (TIS) or masked (MIS, cap 2) pi_old / pi_sampler. Without
    them pi_old is the current policy: ratio 1 and weights min(pi / pi_sampler, 2) =
    min([3.3, 0.5], 2) = [2, 0.5]. kl_approx is the mean of old - current = -log(1.1) / 2.
    ESS uses pi / pi_sampler = [3.3, 0.5]: 3.8^2 / (3.3^2 + 0.25) / 2 tokens."""
    td = one_row_batch(actor, [LOG(1.1), 0.0], [LOG(3.0), LOG(0.5)], with_old=with_old)
    out = GRPOLoss(actor, importance_correction=mode, importance_cap=2.0)(td)
    close(out.loss_objective, expected)
    close(out.kl_approx, -LOG(1.1) / 2 if with_old else 0.0)
    close(out.ESS, 3.8**2 / (3.3**2 + 0.25) / 2)


def k3(u):
    return math.exp(u) - 1 - u


RHO = [[0.5, -0.2], [0.1, 0.3, -0.4]]


@pytest.mark.parametrize("estimator", ["k3", "k2"])
@pytest.mark.parametrize("correction", ["importance", None])
def test_kl_terms_and_reported_kl(actor, estimator, correction):
    """With ref = cur - rho and sampled = cur - delta, per token:
    k3 to the reference = exp(-rho) - 1 + rho, k2 = rho^2 / 2; the importance form weighs the
    term by w = pi / pi_sampler = exp(delta). kl_to_ref reports the masked mean of the
    estimate (never weighted, never diluted). The KL to the sampling policy uses
    u = sampled - cur = -delta in place of -rho. Coefficients 0.1 and 0.05, token-mean."""
    estimate = {"k3": lambda r: k3(-r), "k2": lambda r: r * r / 2}[estimator]
    deltas = [d for row in BASE_DELTA for d in row]
    rhos = [r for row in RHO for r in row]
    weights = [math.exp(d) if correction == "importance" else 1.0 for d in deltas]
    loss = GRPOLoss(actor, kl_to_ref_coeff=0.1, kl_to_inference_coeff=0.05, kl_estimator=estimator, kl_correction=correction)
    out = loss(grid_batch(actor, BASE_DELTA, rho_rows=RHO))
    close(out.kl_to_ref, sum(estimate(r) for r in rhos) / 5)
    close(out.loss_kl_to_ref, 0.1 * sum(w * estimate(r) for w, r in zip(weights, rhos)) / 5)
    close(out.kl_to_inference, sum(estimate(d) for d in deltas) / 5)
    close(out.loss_kl_to_inference, 0.05 * sum(w * estimate(d) for w, d in zip(weights, deltas)) / 5)
    total = out.loss_objective + out.loss_entropy + out.loss_kl_to_ref + out.loss_kl_to_inference
    close(out.total_loss(), total.detach())


def test_ess_of_known_weights(actor):
    """Log-weights [log 2, 0, 0, log 0.5] over four response tokens: ESS = 4.5^2 / 6.25 = 3.24,
    reported per token as 3.24 / 4 = 0.81. Padding holds NaN and does not count."""
    tokens = torch.randint(0, 250, (1, 7))
    attention = torch.ones(1, 7, dtype=torch.bool)
    attention[0, -1] = False
    loss_mask = torch.zeros(1, 7, dtype=torch.bool)
    loss_mask[0, 2:6] = True
    delta = place([[LOG(2.0), 0.0, 0.0, LOG(0.5)]], loss_mask)
    td = make_batch(actor, tokens, attention, loss_mask, torch.tensor([0.5]), delta=delta, outside=float("nan"))
    close(GRPOLoss(actor)(td).ESS, 0.81)


def naive_entropies(model, tokens, attention):
    """Entropy of p(. | x_<t) at each position, one unpadded row at a time from full logits."""
    out = torch.zeros(tokens.shape, dtype=F64)
    for row in range(tokens.shape[0]):
        cols = torch.nonzero(attention[row]).flatten()
        logits = model(input_ids=tokens[row, cols][None]).logits[0, :-1].double()
        logp = F.log_softmax(logits, -1)
        out[row, cols[1:]] = -(logp.exp() * logp).sum(-1)
    return out


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_entropy_matches_full_logits(actor, mode):
    """The reported entropy is the masked token mean of the exact categorical entropy (full
    logits, row by row); the bonus is -coeff * aggregate(entropy) in the loss's mode."""
    tokens, attention, loss_mask = two_row_grid()
    with torch.no_grad():
        naive = naive_entropies(actor.model, tokens, attention)
    out = GRPOLoss(actor, entropy_coeff=0.03, aggregation=mode)(grid_batch(actor, BASE_DELTA))
    valid = naive[loss_mask]
    close(out.entropy, valid.mean(), atol=1e-10)
    rows = [naive[0][loss_mask[0]].mean(), naive[1][loss_mask[1]].mean()]
    expected = valid.mean() if mode == "token-mean" else (rows[0] + rows[1]) / 2
    close(out.loss_entropy, -0.03 * expected, atol=1e-10)


def test_without_entropy_bonus_fields_are_none(actor):
    out = GRPOLoss(actor, entropy_bonus=False)(grid_batch(actor, BASE_DELTA))
    assert out.entropy is None and out.loss_entropy is None and out.loss_kl_to_ref is None
    close(out.total_loss(), out.loss_objective.detach())


@pytest.mark.parametrize("shape", ["[B]", "[B,1]", "[B,T]", "[B,T,1]", "jagged"])
def test_advantage_shapes_broadcast_per_token(actor, shape):
    """A per-sequence advantage [B] or [B, 1] equals the same value repeated on every token as
    [B, T], [B, T, 1] or a jagged [B, j]; all give the first test's token-mean 0.74."""
    td = grid_batch(actor, BASE_DELTA)
    tokens, attention, _ = two_row_grid()
    per_token = ADV.to(F64)[:, None].expand(tokens.shape).clone()
    forms = {
        "[B]": ADV.to(F64),
        "[B,1]": ADV.to(F64)[:, None],
        "[B,T]": per_token,
        "[B,T,1]": per_token[..., None],
        "jagged": torch.nested.nested_tensor([per_token[0][attention[0]], per_token[1][attention[1]]], layout=torch.jagged),
    }
    td["advantage"] = forms[shape]
    close(GRPOLoss(actor)(td).loss_objective, 3.7 / 5)
