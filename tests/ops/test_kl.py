"""KL estimators and kl_loss_term: exact enumeration of values, variances and expected gradients.

Enumeration convention: for a distribution over V outcomes, the vector ``log_softmax(theta)``
holds the log-prob of every possible sample, so evaluating an estimator element-wise on it
gives each outcome's per-sample term. The expected gradient under a sampling distribution
``q`` is ``grad sum_x q(x) * term_x`` with ``q`` held constant, which is the probability-
weighted sum of the per-outcome autograd gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.ops import (
    KL_CORRECTIONS,
    KL_ESTIMATORS,
    kl_abs,
    kl_estimate,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_loss_term,
    reward_to_go,
)

F64 = torch.float64
POLICY = [1.0, 0.0, -1.0]
REFERENCE = [0.0, 0.0, 0.0]
GRAD_REVERSE = [0.282587, -0.140770, -0.141817]
GRAD_FORWARD = [0.331908, -0.088605, -0.243303]
SPEC_ATOL = 5e-7  # SPEC values are rounded to 6 decimals


def _theta(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64, requires_grad=True)


def _expected_grad(theta: torch.Tensor, weights: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad((weights.detach() * terms).sum(), theta, retain_graph=True)[0]


def _close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), rtol=0, atol=atol)


def _reverse_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return (logp.exp() * (logp - ref_logp)).sum(-1)


# ---------------------------------------------------------------- values and variances


def test_spec_expectations_and_variances():
    """SPEC section 3: pi = softmax[1, 0, -1], pi_ref uniform.

    KL = sum_x pi (log pi - log 1/3) = 0.266217; E[k1] = E[k3] = KL (both unbiased),
    E[k2] = 0.247638; Var k1 = 0.424405, Var k2 = 0.043233, Var k3 = 0.129174.
    """
    logp = torch.tensor(POLICY, dtype=F64).log_softmax(0)
    ref = torch.tensor(REFERENCE, dtype=F64).log_softmax(0)
    p = logp.exp()
    _close(_reverse_kl(logp, ref), 0.266217, SPEC_ATOL)
    expected = {"k1": (0.266217, 0.424405), "k2": (0.247638, 0.043233), "k3": (0.266217, 0.129174)}
    for name, (mean, variance) in expected.items():
        values = kl_estimate(logp, ref, name)
        m = (p * values).sum()
        _close(m, mean, SPEC_ATOL)
        _close((p * (values - m) ** 2).sum(), variance, SPEC_ATOL)


def test_k1_k3_unbiased_and_abs_biased_upward_on_random_pairs():
    """E_pi[k1] = E_pi[k3] = KL exactly (E_pi[pi_ref/pi] = 1); E_pi|r| >= KL; E_pi[k2] != KL."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        logp = torch.randn(7, generator=gen, dtype=F64).log_softmax(0)
        ref = (2 * torch.randn(7, generator=gen, dtype=F64)).log_softmax(0)
        p, kl = logp.exp(), _reverse_kl(logp, ref)
        _close((p * kl_k1(logp, ref)).sum(), kl)
        _close((p * kl_k3(logp, ref)).sum(), kl)
        assert (p * kl_abs(logp, ref)).sum() >= kl
        assert abs((p * kl_k2(logp, ref)).sum() - kl) > 1e-3


def test_estimators_hand_values():
    """r = logp - ref = 0.5: k1 = 0.5, k2 = 0.125, k3 = e^-0.5 - 1 + 0.5, abs(-0.5) = 0.5."""
    logp, ref = torch.tensor([0.0, -1.0], dtype=F64), torch.tensor([-0.5, -0.5], dtype=F64)
    _close(kl_k1(logp, ref), [0.5, -0.5])
    _close(kl_k2(logp, ref), [0.125, 0.125])
    _close(kl_k3(logp, ref), [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5])
    _close(kl_abs(logp, ref), [0.5, 0.5])
    for name, fn in KL_ESTIMATORS.items():
        _close(kl_estimate(logp, ref, name), fn(logp, ref))
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "abs"}


def test_k3_accurate_near_zero():
    """For d = ref - logp = 1e-6, k3 = d^2/2 + d^3/6 + O(d^4) = 5.000003333e-13.

    exp(d) - 1 - d in float64 has an absolute error ~1e-16, i.e. a relative error ~2e-4
    here; expm1 keeps it below 1e-9.
    """
    d = 1e-6
    value = kl_k3(torch.tensor([0.0], dtype=F64), torch.tensor([d], dtype=F64))
    series = d**2 / 2 + d**3 / 6 + d**4 / 24
    torch.testing.assert_close(value, torch.tensor([series], dtype=F64), rtol=1e-9, atol=0)


@settings(max_examples=60, deadline=None)
@given(st.floats(-30, 30), st.floats(-30, 30))
def test_estimators_match_definitions_and_signs(logp, ref):
    """Against the textbook formulas in float64; k2, k3 and abs are never negative."""
    a, b = torch.tensor([logp], dtype=F64), torch.tensor([ref], dtype=F64)
    r = logp - ref
    torch.testing.assert_close(kl_k3(a, b), torch.tensor([math.exp(-r) - 1 + r], dtype=F64), rtol=1e-9, atol=1e-12)
    for fn in (kl_k2, kl_k3, kl_abs):
        assert fn(a, b).item() >= 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_log_ratios_stay_finite(dtype):
    """|r| = 100: k1, k2, abs are finite; k3 = e^{-r} - 1 + r is 99 at r = 100, and
    e^100 + ... at r = -100, which only float64 can represent."""
    logp = torch.tensor([0.0, -100.0], dtype=dtype, requires_grad=True)
    ref = torch.tensor([-100.0, 0.0], dtype=dtype)
    for name in ("k1", "k2", "abs"):
        value = kl_estimate(logp, ref, name)
        (grad,) = torch.autograd.grad(value.sum(), logp)
        assert torch.isfinite(value).all() and torch.isfinite(grad).all()
    k3 = kl_k3(logp, ref)
    assert k3[0].item() == pytest.approx(99.0)
    if dtype == F64:
        assert k3[1].item() == pytest.approx(math.exp(100) - 101, rel=1e-12)
        for estimator in ("k2", "k3"):
            term = kl_loss_term(logp, ref, estimator=estimator, old_logp=logp.detach() + 1.0)
            (grad,) = torch.autograd.grad(term.sum(), logp)
            assert torch.isfinite(term).all() and torch.isfinite(grad).all()


# ---------------------------------------------------------------- expected gradients, one token


def test_spec_expected_gradients():
    """SPEC section 3 gradients w.r.t. the policy logits (samples from pi):

    * k1 as a reward (score function, sum_x pi k1 grad log pi) = grad KL(pi||pi_ref);
    * k2 as a loss (raw and importance, on-policy) = grad KL(pi||pi_ref);
    * k3 as a loss with correction=None = grad KL(pi_ref||pi);
    * k3 importance-weighted, on-policy = grad KL(pi||pi_ref);
    * k1 as a loss: sum_x pi grad log pi = 0.
    """
    theta = _theta(POLICY)
    ref = torch.tensor(REFERENCE, dtype=F64).log_softmax(0)
    logp = theta.log_softmax(0)
    p = logp.exp()
    reward_k1 = kl_k1(logp, ref).detach() * logp
    _close(_expected_grad(theta, p, reward_k1), GRAD_REVERSE, SPEC_ATOL)
    for correction in KL_CORRECTIONS:
        k2 = kl_loss_term(logp, ref, estimator="k2", correction=correction)
        _close(_expected_grad(theta, p, k2), GRAD_REVERSE, SPEC_ATOL)
    raw_k3 = kl_loss_term(logp, ref, estimator="k3", correction=None)
    _close(_expected_grad(theta, p, raw_k3), GRAD_FORWARD, SPEC_ATOL)
    weighted_k3 = kl_loss_term(logp, ref, estimator="k3")
    _close(_expected_grad(theta, p, weighted_k3), GRAD_REVERSE, SPEC_ATOL)
    _close(_expected_grad(theta, p, kl_k1(logp, ref)), [0.0, 0.0, 0.0])


def test_spec_gradients_are_the_true_divergence_gradients():
    """The SPEC vectors are autograd of KL(pi||pi_ref) and KL(pi_ref||pi) at pi = softmax[1,0,-1]."""
    theta = _theta(POLICY)
    ref = torch.tensor(REFERENCE, dtype=F64).log_softmax(0)
    logp = theta.log_softmax(0)
    reverse = torch.autograd.grad(_reverse_kl(logp, ref), theta, retain_graph=True)[0]
    forward = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta)[0]
    _close(reverse, GRAD_REVERSE, SPEC_ATOL)
    _close(forward, GRAD_FORWARD, SPEC_ATOL)


def test_k3_and_abs_as_reward_are_biased():
    """Score-function gradients of k3 and abs as rewards.

    d/dtheta E_pi[k3] = E_pi[k3 grad log pi] + E_pi[grad k3] and E_pi[k3] = KL(pi||ref), while
    E_pi[grad k3] = grad KL(ref||pi); hence E_pi[k3 grad log pi] = grad KL(pi||ref) -
    grad KL(ref||pi), as the docstring of kl_k3 states.
    """
    theta = _theta(POLICY)
    ref = torch.tensor(REFERENCE, dtype=F64).log_softmax(0)
    logp = theta.log_softmax(0)
    p = logp.exp()
    got = _expected_grad(theta, p, kl_k3(logp, ref).detach() * logp)
    expected = torch.tensor(GRAD_REVERSE, dtype=F64) - torch.tensor(GRAD_FORWARD, dtype=F64)
    _close(got, expected, 1e-6)
    abs_reward = _expected_grad(theta, p, kl_abs(logp, ref).detach() * logp)
    assert (abs_reward - torch.tensor(GRAD_REVERSE, dtype=F64)).abs().max() > 1e-2


OLD_POLICY = [0.3, -0.5, 0.8]


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_importance_correction_off_policy_gives_reverse_kl_gradient(estimator):
    """Samples from pi_old = softmax[0.3, -0.5, 0.8] != pi.

    sum_x pi_old(x) grad(w k3) = grad sum_x pi k3 = grad E_pi[k3] = grad KL(pi||ref), and
    sum_x pi_old sg(w) grad k2 = sum_x pi r grad log pi = grad KL(pi||ref).
    The values are unbiased too for k3: sum_x pi_old w k3 = KL.
    """
    theta = _theta(POLICY)
    ref = torch.tensor(REFERENCE, dtype=F64).log_softmax(0)
    old = torch.tensor(OLD_POLICY, dtype=F64).log_softmax(0)
    logp = theta.log_softmax(0)
    term = kl_loss_term(logp, ref, estimator=estimator, old_logp=old)
    _close(_expected_grad(theta, old.exp(), term), GRAD_REVERSE, SPEC_ATOL)
    if estimator == "k3":
        _close((old.exp() * term).sum(), _reverse_kl(logp, ref))


def test_uncorrected_terms_are_wrong_off_policy():
    """Without the weight, off-policy samples give sum_x pi_old grad(term), which is not
    grad KL: this is what the importance correction fixes (and what a detached k3 weight
    would break, since it drops the E[k3 grad log pi] part)."""
    theta = _theta(POLICY)
    ref = torch.tensor(REFERENCE, dtype=F64).log_softmax(0)
    old = torch.tensor(OLD_POLICY, dtype=F64).log_softmax(0)
    logp = theta.log_softmax(0)
    target = torch.tensor(GRAD_REVERSE, dtype=F64)
    for estimator in ("k2", "k3"):
        raw = kl_loss_term(logp, ref, estimator=estimator, correction=None)
        assert (_expected_grad(theta, old.exp(), raw) - target).abs().max() > 1e-2
    detached = torch.exp(logp - old).detach() * kl_k3(logp, ref)
    assert (_expected_grad(theta, old.exp(), detached) - target).abs().max() > 1e-2


def test_on_policy_importance_value_equals_raw_value():
    """old_logp=None means old = sg(logp): w = 1 in value, so the term equals the estimator."""
    logp = torch.randn(3, 5, dtype=F64, requires_grad=True)
    ref = torch.randn(3, 5, dtype=F64)
    for estimator, fn in (("k2", kl_k2), ("k3", kl_k3)):
        _close(kl_loss_term(logp, ref, estimator=estimator), fn(logp, ref))
        _close(kl_loss_term(logp, ref, estimator=estimator, old_logp=logp.detach()), fn(logp, ref))


def test_reference_gets_no_gradient():
    logp = torch.randn(2, 3, dtype=F64, requires_grad=True)
    ref = torch.randn(2, 3, dtype=F64, requires_grad=True)
    kl_loss_term(logp, ref).sum().backward()
    assert ref.grad is None and logp.grad is not None


# ---------------------------------------------------------------- two-token sequences


V = 3


def _two_token_world():
    """An autoregressive toy: token 1 ~ softmax(a), token 2 ~ softmax(b[x1]); same for the
    reference with fixed (c, d). Returns the trainable (a, b) and, for all V^2 sequences in
    row-major order of (x1, x2), the per-token log-probs [V^2, 2] and references [V^2, 2]."""
    gen = torch.Generator().manual_seed(11)
    a = torch.randn(V, generator=gen, dtype=F64).requires_grad_()
    b = torch.randn(V, V, generator=gen, dtype=F64).requires_grad_()
    c, d = torch.randn(V, generator=gen, dtype=F64), torch.randn(V, V, generator=gen, dtype=F64)
    return a, b, _token_table(a, b), _token_table(c, d).detach()


def _token_table(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    l1 = first.log_softmax(0)[:, None].expand(V, V)
    l2 = second.log_softmax(1)
    return torch.stack([l1, l2], dim=-1).reshape(V * V, 2)


def _sequence_kl(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    seq, seq_ref = logp.sum(-1), ref.sum(-1)
    return (seq.exp() * (seq - seq_ref)).sum()


def _grads(total: torch.Tensor, a, b) -> torch.Tensor:
    ga, gb = torch.autograd.grad(total, (a, b), retain_graph=True, allow_unused=True, materialize_grads=True)
    return torch.cat([ga, gb.reshape(-1)])


def test_k1_reward_with_reward_to_go_gives_sequence_kl_gradient():
    """REINFORCE with k1 as a per-token penalty and the return G_t = sum_{s>=t} k1_s:
    E[sum_t G_t grad log pi_t] = E[(sum_s k1_s)(sum_t grad log pi_t)] because
    E[k1_s grad log pi_t] = 0 for s < t; that is grad KL(P||P_ref) of the sequence law."""
    a, b, logp, ref = _two_token_world()
    probs = logp.sum(-1).exp()
    mask = torch.ones_like(logp, dtype=torch.bool)
    returns = reward_to_go(kl_k1(logp, ref).detach(), mask)
    surrogate = (returns * logp).sum(-1)
    _close(_grads((probs.detach() * surrogate).sum(), a, b), _grads(_sequence_kl(logp, ref), a, b))


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_sequence_level_loss_term_gives_sequence_kl_gradient(estimator):
    """kl_loss_term on sequence log-probs log P = sum_t log pi_t (shape [V^2, 1]) is the
    one-token case on the space of sequences, so its expected gradient is exact, on-policy
    and with sequences from an old policy."""
    a, b, logp, ref = _two_token_world()
    target = _grads(_sequence_kl(logp, ref), a, b)
    seq, seq_ref = logp.sum(-1, keepdim=True), ref.sum(-1, keepdim=True)
    term = kl_loss_term(seq, seq_ref, estimator=estimator)
    _close(_grads((seq.exp().detach() * term).sum(), a, b), target)
    gen = torch.Generator().manual_seed(5)
    old = _token_table(torch.randn(V, generator=gen, dtype=F64), torch.randn(V, V, generator=gen, dtype=F64))
    old_seq = old.sum(-1, keepdim=True)
    term = kl_loss_term(seq, seq_ref, estimator=estimator, old_logp=old_seq)
    _close(_grads((old_seq.exp() * term).sum(), a, b), target)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_per_token_loss_terms_hold_contexts_fixed(estimator):
    """Summing per-token terms over the sequence differentiates each token's KL with its
    context held fixed: E[sum_t grad term_t] = grad[KL_1 + sum_x1 sg(pi(x1)) KL_2(x1)].

    The sequence KL is KL_1 + sum_x1 pi(x1) KL_2(x1); its gradient has the extra term
    sum_x1 grad pi(x1) KL_2(x1) (earlier tokens choose later contexts). So the per-token sum
    matches the sequence gradient w.r.t. the second-token logits b exactly, and misses
    exactly that term w.r.t. the first-token logits a.
    """
    a, b, logp, ref = _two_token_world()
    probs = logp.sum(-1).exp().detach()
    per_token = kl_loss_term(logp, ref, estimator=estimator).sum(-1)
    got = _grads((probs * per_token).sum(), a, b)

    l1, r1 = a.log_softmax(0), ref[::V, 0]
    l2, r2 = b.log_softmax(1), ref[:, 1].reshape(V, V)
    kl_first = (l1.exp() * (l1 - r1)).sum()
    kl_second = (l2.exp() * (l2 - r2)).sum(-1)  # [V], one per context x1
    _close(got, _grads(kl_first + (l1.exp().detach() * kl_second).sum(), a, b))

    target = _grads(_sequence_kl(logp, ref), a, b)
    _close(got[V:], target[V:])
    future = _grads((l1.exp() * kl_second.detach()).sum(), a, b)
    _close(target - got, future)
    assert future[:V].abs().max() > 1e-2


# ---------------------------------------------------------------- errors


def test_k1_and_abs_refused_as_loss():
    logp, ref = torch.zeros(2, 3), torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"(?s)k1.*gradient.*zero.*reward"):
        kl_loss_term(logp, ref, estimator="k1")
    with pytest.raises(ValueError, match=r"(?s)k1.*zero"):
        kl_loss_term(logp, ref, estimator="k1", correction=None)
    with pytest.raises(ValueError, match=r"abs"):
        kl_loss_term(logp, ref, estimator="abs")


def test_unknown_names_list_supported():
    logp, ref = torch.zeros(2, 3), torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"estimator: expected one of .*'k1', 'k2', 'k3', 'abs'.*, got 'k9'"):
        kl_estimate(logp, ref, "k9")
    with pytest.raises(ValueError, match=r"estimator: expected one of .*'k2', 'k3'.*, got 'k9'"):
        kl_loss_term(logp, ref, estimator="k9")
    with pytest.raises(ValueError, match=r"correction: expected one of .*'importance', None.*, got 'sg'"):
        kl_loss_term(logp, ref, correction="sg")


def test_shape_and_type_errors():
    with pytest.raises(ValueError, match=r"ref_logp must have the shape of logp \(2, 3\); got \(3,\)"):
        kl_k3(torch.zeros(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"old_logp must have the shape of logp"):
        kl_loss_term(torch.zeros(2, 3), torch.zeros(2, 3), old_logp=torch.zeros(2, 4))
    with pytest.raises(TypeError, match=r"logp and ref_logp must be torch.Tensor"):
        kl_k1([0.0], torch.zeros(1))
    with pytest.raises(ValueError, match=r"old_logp is only used by correction='importance'"):
        kl_loss_term(torch.zeros(2, 3), torch.zeros(2, 3), old_logp=torch.zeros(2, 3), correction=None)
