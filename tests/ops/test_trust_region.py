"""DPPO's trust-region masks, the unclipped surrogate they cut, and their checks.

One row of seven tokens, hand-derived in float64. ``p`` is the current policy's probability of
the sampled token, ``q`` the sampler's, ``A`` the advantage:

    t   p     q     A    p - q   KL_bin(q || p)
    0   0.5   0.25  +1   +0.25   0.25 ln 0.5 + 0.75 ln 1.5                      = 0.1308120
    1   0.5   0.25  -1   +0.25   0.1308120
    2   0.1   0.4   -1   -0.30   0.4 ln 4 + 0.6 ln(0.6 / 0.9)                    = 0.3112387
    3   0.99  0.9   +1   +0.09   0.9 ln(0.9 / 0.99) + 0.1 ln(0.1 / 0.01)         = 0.1444793
    4   0.3   0.3    0    0      0
    5   0.3   0.9   +1   -0.60   0.9 ln 3 + 0.1 ln(0.1 / 0.7)                    = 0.7941600
    6   0.2   0.3   -1   -0.10   0.3 ln 1.5 + 0.7 ln(0.7 / 0.8)                  = 0.0281676

TV at d = 0.2: t0 cut (A > 0, p rose by 0.25 > 0.2); t1 kept (A < 0 pushes p back down); t2 cut
(A < 0, p fell by 0.3 > 0.2); t3 kept (rise 0.09); t4 no gradient, never counted; t5 kept (A > 0
pushes p back up); t6 kept (fall 0.1). KL at (low, high) = (0.2, 0.14): t0 kept (0.131 <= 0.14);
t2 cut (0.311 > 0.2, p < q, A < 0); t3 cut (0.144 > 0.14, p > q, A > 0): the high-probability
token DPPO says a ratio clip under-constrains (ratio 1.1 is inside PPO's 0.2 clip); t5 kept (p < q
with A > 0); t6 kept (0.028).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from tether.ops import TRUST_REGIONS, bernoulli_kl, clipped_surrogate, trust_region_surrogate, tv_shift
from tether.ops.trust_region import check_trust_region, masked_surrogate

F64 = torch.float64
P = [0.5, 0.5, 0.1, 0.99, 0.3, 0.3, 0.2]
Q = [0.25, 0.25, 0.4, 0.9, 0.3, 0.9, 0.3]
A = [1.0, -1.0, -1.0, 1.0, 0.0, 1.0, -1.0]
KL = [0.1308120, 0.1308120, 0.3112387, 0.1444793, 0.0, 0.7941600, 0.0281676]
TV_CUT = [True, False, True, False, False, False, False]
KL_CUT = [False, False, True, True, False, False, False]


def _row(values):
    return torch.tensor([values], dtype=F64)


def _inputs():
    logp = _row(P).log().requires_grad_()
    q_log = _row(Q).log()
    return logp, q_log, _row(A)


def test_tv_shift_and_bernoulli_kl_by_hand():
    logp, q_log, _ = _inputs()
    torch.testing.assert_close(tv_shift(logp, q_log), _row(P) - _row(Q), rtol=0, atol=1e-15)
    torch.testing.assert_close(bernoulli_kl(logp, q_log), _row(KL), rtol=0, atol=5e-8)


def test_bernoulli_kl_at_the_edges():
    """``q = 1``: ``KL = ln(1 / p)`` (the 0 ln 0 term is 0, not NaN); ``p = 1 > q``: ``+inf``;
    ``p = q``: 0; ``p`` a hair below 1 keeps its digits through ``-expm1``."""
    got = bernoulli_kl(_row([0.0, math.log(0.25), math.log(0.5), -1e-12]), _row([math.log(0.25), 0.0, math.log(0.5), 0.0]))
    assert float(got[0, 0]) == math.inf
    torch.testing.assert_close(got[0, 1:], torch.tensor([math.log(4.0), 0.0, 1e-12], dtype=F64), rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize(("kind", "delta", "cut"), [("dppo_tv", 0.2, TV_CUT), ("dppo_kl", (0.2, 0.14), KL_CUT)])
def test_dppo_masks_values_and_gradients_by_hand(kind, delta, cut):
    """Kept tokens carry ``-r A`` and the plain policy gradient ``d/dlogp = -r A`` (``r = p / q``);
    cut ones carry 0 and exactly 0 gradient."""
    logp, q_log, adv = _inputs()
    out = trust_region_surrogate(logp - q_log, adv, logp, q_log, kind=kind, delta=delta)
    cut_t = torch.tensor([cut])
    assert torch.equal(out.clipped, cut_t)
    ratio = _row(P) / _row(Q)
    expected = torch.where(cut_t, 0.0, -ratio * adv)
    torch.testing.assert_close(out.loss, expected, rtol=0, atol=1e-14)
    out.loss.sum().backward()
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-14)
    assert torch.all(logp.grad[cut_t] == 0.0)


def test_masked_fraction_counts_only_tokens_with_an_advantage():
    """A cut ``A = 0`` token is not counted (it has no gradient to cut): 2 of 7 here."""
    logp, q_log, adv = _inputs()
    out = masked_surrogate(logp - q_log, adv, torch.tensor([[True, False, True, False, True, False, False]]))
    assert float(out.clipped.to(F64).mean()) == pytest.approx(2 / 7, abs=1e-15)


def test_none_is_the_unclipped_surrogate_and_clip_is_ppo():
    logp, q_log, adv = _inputs()
    free = trust_region_surrogate(logp - q_log, adv, logp, q_log, kind="none")
    torch.testing.assert_close(free.loss, -(_row(P) / _row(Q)) * adv, rtol=0, atol=1e-14)
    assert not free.clipped.any()
    clip = trust_region_surrogate(logp - q_log, adv, logp, q_log, kind="clip", clip_epsilon=(0.1, 0.3))
    ppo = clipped_surrogate(logp - q_log, adv, clip_epsilon=(0.1, 0.3))
    assert torch.equal(clip.loss, ppo.loss) and torch.equal(clip.clipped, ppo.clipped)


def test_dual_clip_cuts_negative_advantages_past_c_in_every_kind():
    """t1 has ratio 2 and ``A < 0``: kept by the TV mask, cut by a dual clip of 1.5."""
    logp, q_log, adv = _inputs()
    out = trust_region_surrogate(logp - q_log, adv, logp, q_log, kind="dppo_tv", dual_clip=1.5)
    assert out.clipped[0].tolist() == [True, True, True, False, False, False, False]


def test_registry_names_every_kind():
    assert set(TRUST_REGIONS) == {"clip", "none", "dppo_tv", "dppo_kl"}


@pytest.mark.parametrize(("kind", "delta", "error", "words"), [
    ("dppo_tx", 0.2, ValueError, "trust_region: expected one of"),
    ("dppo_tv", (0.2, 1.0), ValueError, "trust_region_delta high: expected a finite number in (0, 1)"),
    ("dppo_kl", 0.0, ValueError, "trust_region_delta low: expected a finite number > 0"),
    ("dppo_kl", (0.1, 0.2, 0.3), TypeError, "a (low, high) pair"),
    ("dppo_kl", "0.1", TypeError, "a (low, high) pair"),
])
def test_bad_options_are_named(kind, delta, error, words):
    with pytest.raises(error, match=re.escape(words)):
        check_trust_region(kind, delta)


def test_dppo_kl_takes_thresholds_above_one():
    assert check_trust_region("dppo_kl", (0.5, 2.0)) == (0.5, 2.0)
