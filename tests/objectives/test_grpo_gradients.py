"""GRPOLoss gradients: KL terms by exact enumeration, the surrogate by hand, and gradient
accumulation over micro-batches."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tether.objectives import GRPOLoss
from tether.ops import AGGREGATION_MODES, aggregate_denominator
from tests.objectives.helpers import F64, UnigramActor, make_batch, place, tiny_wrapper

POLICY = [1.0, 0.0, -1.0]
REF = [0.0, 0.0, 0.0]
GRAD_REVERSE = [0.282587, -0.140770, -0.141817]  # grad KL(pi || pi_ref), SPEC section 3
GRAD_FORWARD = [0.331908, -0.088605, -0.243303]  # grad KL(pi_ref || pi)


def expected_kl_gradient(loss_kwargs, old_logits, target_logits, field):
    """sum_a pi_old(a) * grad loss(a): the expected gradient over one-token responses a ~ pi_old.

    Each response is scored as the row [prompt 0, a] by a context-free policy; the sampling
    log-prob is log pi_old(a) and the reference (or, for the inference KL, the sampler) is
    the target distribution."""
    actor = UnigramActor(POLICY)
    old = F.log_softmax(torch.tensor(old_logits, dtype=F64), -1)
    target = F.log_softmax(torch.tensor(target_logits, dtype=F64), -1)
    loss = GRPOLoss(actor, entropy_bonus=False, **loss_kwargs)
    total = torch.zeros(3, dtype=F64)
    for action in range(3):
        td = make_batch(actor, torch.tensor([[0, action]]), torch.ones(1, 2, dtype=torch.bool),
                        torch.tensor([[False, True]]), torch.tensor([0.0]))
        td["log_probs", "full"] = torch.tensor([[0.0, old[action].item()]], dtype=F64)
        td["ref_log_probs", "full"] = torch.tensor([[0.0, target[action].item()]], dtype=F64)
        (grad,) = torch.autograd.grad(getattr(loss(td), field), actor.logits)
        total += old[action].exp() * grad
    return total


def exact_reverse_kl_gradient(target_logits):
    logits = torch.tensor(POLICY, dtype=F64, requires_grad=True)
    logp, ref = F.log_softmax(logits, -1), F.log_softmax(torch.tensor(target_logits, dtype=F64), -1)
    (grad,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), logits)
    return grad


@pytest.mark.parametrize("estimator", ["k3", "k2"])
@pytest.mark.parametrize("old_logits", [POLICY, [0.0, 0.5, 0.0]], ids=["on-policy", "off-policy"])
def test_importance_kl_term_has_the_reverse_kl_gradient(estimator, old_logits):
    """Policy logits [1, 0, -1], reference uniform. Enumerating the three one-token
    responses weighted by pi_old: sum_a pi_old(a) grad(w k3)(a) = grad sum_a pi(a) k3(a) =
    grad KL(pi || pi_ref) (and likewise for sg(w) k2), on-policy and from pi_old = softmax
    [0, 0.5, 0]. SPEC value: [0.282587, -0.140770, -0.141817]."""
    got = expected_kl_gradient(
        {"kl_to_ref_coeff": 1.0, "kl_estimator": estimator, "kl_correction": "importance"}, old_logits, REF, "loss_kl_to_ref"
    )
    torch.testing.assert_close(got, torch.tensor(GRAD_REVERSE, dtype=F64), rtol=0, atol=5e-7)


def test_raw_k3_follows_the_forward_kl_gradient():
    """kl_correction=None reproduces the GRPO paper / TorchRL term: on-policy its expected
    gradient is grad KL(pi_ref || pi) = [0.331908, -0.088605, -0.243303], not the reverse KL."""
    got = expected_kl_gradient({"kl_to_ref_coeff": 1.0, "kl_correction": None}, POLICY, REF, "loss_kl_to_ref")
    torch.testing.assert_close(got, torch.tensor(GRAD_FORWARD, dtype=F64), rtol=0, atol=5e-7)


def test_kl_to_inference_has_the_reverse_kl_gradient():
    """The KL to the sampling policy pi_s = softmax [0, 0.5, 0], samples from pi_s: the
    expected gradient of w k3(cur, sampled) is grad KL(pi || pi_s), here checked against
    autograd of the exact KL (and the coefficient 0.3 scales it)."""
    sampler = [0.0, 0.5, 0.0]
    got = expected_kl_gradient({"kl_to_inference_coeff": 0.3}, sampler, REF, "loss_kl_to_inference")
    torch.testing.assert_close(got, 0.3 * exact_reverse_kl_gradient(sampler), rtol=0, atol=1e-12)


def test_surrogate_gradient_by_hand():
    """Context-free policy pi = softmax(z), z = [1, 0, -1]; one row [prompt 0, 1, 2, 0] with
    A = +1 and ratios [1, 1.5, 1] (the middle token is clipped, eps 0.2). Token-mean loss
    -(1/3) sum_t r_t A, whose gradient is -(1/3) A sum over unclipped tokens of
    r_t grad log pi(a_t), with grad_z log pi(a) = e_a - pi."""
    actor = UnigramActor(POLICY)
    tokens = torch.tensor([[0, 1, 2, 0]])
    loss_mask = torch.tensor([[False, True, True, True]])
    delta = place([[0.0, math.log(1.5), 0.0]], loss_mask)
    td = make_batch(actor, tokens, torch.ones(1, 4, dtype=torch.bool), loss_mask, torch.tensor([1.0]), delta=delta)
    out = GRPOLoss(actor, entropy_bonus=False)(td)
    (grad,) = torch.autograd.grad(out.loss_objective, actor.logits)
    pi = F.softmax(torch.tensor(POLICY, dtype=F64), -1)
    eye = torch.eye(3, dtype=F64)
    expected = -((eye[1] - pi) + (eye[0] - pi)) / 3
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-14)


def accumulation_batch(actor):
    """Eight rows of different prompt and response lengths, right-padded to 9 columns."""
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 250, (8, 9), generator=gen)
    lengths = torch.tensor([9, 7, 8, 5, 9, 6, 4, 8])
    prompts = torch.tensor([3, 2, 4, 2, 5, 3, 2, 3])
    cols = torch.arange(9)[None, :]
    attention = cols < lengths[:, None]
    loss_mask = attention & (cols >= prompts[:, None])
    delta = torch.randn(8, 9, generator=gen, dtype=F64) * 0.3
    rho = torch.randn(8, 9, generator=gen, dtype=F64) * 0.5
    advantage = torch.randn(8, generator=gen, dtype=F64)
    return make_batch(actor, tokens, attention, loss_mask, advantage, delta=delta, rho=rho)


@pytest.mark.parametrize("mode", list(AGGREGATION_MODES))
def test_micro_batches_with_full_denominator_match_the_full_batch(mode):
    """The same 8 rows as one batch of 8 and as 8 micro-batches of 1, each given the full
    batch's denominator: summed losses and parameter gradients agree (all four loss terms)."""
    actor = tiny_wrapper(seed=1)
    normalizer = 6.0 if mode == "seq-mean-token-sum-norm" else None
    loss = GRPOLoss(actor, aggregation=mode, normalizer=normalizer, kl_to_ref_coeff=0.2, kl_to_inference_coeff=0.1)
    td = accumulation_batch(actor)
    params = [p for p in loss.parameters() if p.requires_grad]

    full = loss(td).total_loss()
    full_grads = torch.autograd.grad(full, params)

    denominator = aggregate_denominator(td["masks", "all_assistant_mask"], mode)
    summed = torch.zeros((), dtype=F64)
    micro_grads = [torch.zeros_like(p) for p in params]
    for row in range(8):
        part = loss(td[row:row + 1], denominator=denominator).total_loss()
        summed = summed + part.detach()
        for acc, g in zip(micro_grads, torch.autograd.grad(part, params)):
            acc += g
    torch.testing.assert_close(summed, full.detach(), rtol=1e-11, atol=1e-13)
    for got, want in zip(micro_grads, full_grads):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-11)
