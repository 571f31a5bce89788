"""GRPOLoss and MCAdvantage on the real embedded SmolLM2-135M-Instruct model."""

from __future__ import annotations

import random

import pytest
import torch
from tensordict import TensorDict

from tether.models import TransformersWrapper
from tether.models.batch_io import write_objects
from tether.objectives import GRPOLoss, MCAdvantage


def arithmetic_chats(seed: int = 0, prompts: int = 4, group: int = 4):
    """``prompts`` questions with ``group`` answers each (right or wrong), and their rewards."""
    rng = random.Random(seed)
    chats, rewards, group_ids = [], [], []
    for p in range(prompts):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        for _ in range(group):
            answer = a + b + rng.choice([0, 0, 1, -3])
            chats.append([
                {"role": "user", "content": f"What is {a}+{b}? Answer with a number."},
                {"role": "assistant", "content": f"{a} plus {b} makes {answer}."},
            ])
            rewards.append(float(answer == a + b))
            group_ids.append(p)
    return chats, torch.tensor(rewards), torch.tensor(group_ids)


@pytest.mark.integration
def test_forward_and_backward_on_the_embedded_model(embedded):
    """16 chats, 4 prompts x 4 answers, scored once to play the sampler (so the batch is
    on-policy: ratio 1, ESS 1, nothing clipped), advantages by group from MCAdvantage, a
    reference 0.05 nats away on every response token. Every metric is finite, the on-policy
    diagnostics hold up to float32 noise, and the gradient reaches the weights."""
    model, tokenizer = embedded
    actor = TransformersWrapper(model, tokenizer, input_mode="history", generate=False)
    chats, rewards, group_ids = arithmetic_chats()
    td = TensorDict(batch_size=[16])
    write_objects(td, ("history", "full"), chats)
    with torch.no_grad():
        actor(td)
    mask = td["masks", "all_assistant_mask"]
    td["advantage"] = MCAdvantage(4).compute(rewards, group_ids)
    td["ref_log_probs", "full"] = torch.where(mask, td["log_probs", "full"] - 0.05, 0.0)

    loss = GRPOLoss(actor, kl_to_ref_coeff=0.1)
    try:
        out = loss(td)
        out.total_loss().backward()
        for name in loss.out_keys:
            value = getattr(out, name)
            if value is not None:
                assert torch.isfinite(value), name
        assert out.clip_fraction == 0
        torch.testing.assert_close(out.ESS, torch.tensor(1.0), rtol=0, atol=1e-4)
        torch.testing.assert_close(out.kl_approx, torch.tensor(0.0), rtol=0, atol=1e-4)
        # k3 of a constant log-ratio of 0.05: exp(-0.05) - 1 + 0.05.
        torch.testing.assert_close(out.kl_to_ref, torch.tensor(0.05).neg().exp() - 1 + 0.05, rtol=1e-2, atol=0)
        assert 0.1 < float(out.entropy) < 10.0
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and sum(float(g.abs().sum()) for g in grads) > 0
    finally:
        model.zero_grad(set_to_none=True)
