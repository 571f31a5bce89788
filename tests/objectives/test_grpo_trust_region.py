"""``GRPOLoss(trust_region=...)`` on a context-free float64 policy, derived by hand.

``UnigramActor`` with logits ``[0, ln 3]`` gives every token 0 the probability ``p = 0.25`` and
every token 1 ``p = 0.75``; ``make_batch`` sets the sampler's log-probs to ``log p - delta``, and
``delta = ln(p / q)`` picks the sampler's probability ``q``. Two rows of three trained tokens:

    row 0, A = +1: token 1, q = 0.5  (p - q = +0.25 > 0.2: cut)
                   token 1, q = 0.7  (+0.05: kept, r = 0.75 / 0.7)
                   token 0, q = 0.2  (+0.05: kept, r = 1.25)
    row 1, A = -1: token 0, q = 0.5  (-0.25 < -0.2: cut)
                   token 1, q = 0.9  (-0.15: kept, r = 0.75 / 0.9)
                   token 1, q = 0.5  (+0.25, but A < 0 pulls it back: kept, r = 1.5)

Token-mean over 6 tokens: ``(-0.75/0.7 - 1.25 + 0.75/0.9 + 1.5) / 6``; 2 of 6 tokens cut.
"""

from __future__ import annotations

import math

import pytest
import torch

from tether.objectives import GRPOLoss
from tests.objectives.helpers import F64, UnigramActor, make_batch

P = {0: 0.25, 1: 0.75}
ROWS = [([0, 1, 1, 0], [0.5, 0.7, 0.2]), ([1, 0, 1, 1], [0.5, 0.9, 0.5])]
KEPT = torch.tensor([[False, False, True, True], [False, False, True, True]])


def _batch(actor):
    tokens = torch.tensor([tokens for tokens, _ in ROWS])
    attention = torch.ones(2, 4, dtype=torch.bool)
    loss_mask = torch.zeros(2, 4, dtype=torch.bool)
    loss_mask[:, 1:] = True
    delta = torch.zeros(2, 4, dtype=F64)
    for row, (toks, qs) in enumerate(ROWS):
        for col, q in enumerate(qs, start=1):
            delta[row, col] = math.log(P[toks[col]] / q)
    return make_batch(actor, tokens, attention, loss_mask, torch.tensor([1.0, -1.0]), delta=delta), tokens, delta


def test_dppo_tv_loss_mask_fraction_and_gradient_by_hand():
    actor = UnigramActor([0.0, math.log(3.0)])
    batch, tokens, delta = _batch(actor)
    out = GRPOLoss(actor, entropy_bonus=False, trust_region="dppo_tv", trust_region_delta=0.2)(batch)
    expected = (-0.75 / 0.7 - 1.25 + 0.75 / 0.9 + 1.5) / 6
    torch.testing.assert_close(out.loss_objective, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-14)
    assert float(out.clip_fraction) == pytest.approx(2 / 6, abs=1e-15)
    out.loss_objective.backward()
    got = actor.logits.grad.clone()
    # Naive reference: the plain policy gradient of the kept tokens only, -r A summed and divided by 6.
    naive = UnigramActor([0.0, math.log(3.0)])
    logp = torch.log_softmax(naive.logits, -1)[tokens]
    adv = torch.tensor([[1.0], [-1.0]], dtype=F64)
    (torch.where(KEPT, -torch.exp(logp - logp.detach() + delta) * adv, 0.0).sum() / 6).backward()
    torch.testing.assert_close(got, naive.logits.grad, rtol=0, atol=1e-14)
    assert float(got.abs().max()) > 1e-3


def test_none_keeps_every_token_and_clip_is_the_default():
    actor = UnigramActor([0.0, math.log(3.0)])
    batch, _, _ = _batch(actor)
    free = GRPOLoss(actor, entropy_bonus=False, trust_region="none")(batch)
    ratios = [[0.75 / 0.5, 0.75 / 0.7, 1.25], [0.25 / 0.5, 0.75 / 0.9, 1.5]]
    expected = (-sum(ratios[0]) + sum(ratios[1])) / 6
    torch.testing.assert_close(free.loss_objective, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-14)
    assert float(free.clip_fraction) == 0.0
    assert GRPOLoss(actor).trust_region == "clip"


@pytest.mark.parametrize(("kwargs", "error", "pattern"), [
    ({"trust_region": "tv"}, ValueError, r"trust_region: expected one of .*'dppo_tv'.*, got 'tv'"),
    ({"trust_region": "dppo_tv", "trust_region_delta": 1.5}, ValueError, r"trust_region_delta low: .*\(0, 1\)"),
    ({"trust_region": "dppo_kl", "trust_region_delta": -0.1}, ValueError, r"trust_region_delta low: .*> 0"),
])
def test_bad_trust_region_options_fail_at_construction(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        GRPOLoss(UnigramActor([0.0, 1.0]), **kwargs)
