"""The seed's pipeline connects: a batch written by tether's own LLM transforms feeds GRPOLoss.

Sampling wrapper -> ``tether.llm.KLRewardTransform`` (writes ``("next", "ref_log_prob")``)
-> advantage -> ``GRPOLoss(kl_to_ref_coeff=...)``, with no key renamed in between.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tests.helpers import make_tiny_model, make_tokenizer
from tests.llm.naive import PROMPTS
from tether.llm import KLRewardTransform, chat_batch
from tether.models import TransformersWrapper
from tether.objectives import GRPOLoss


def test_kl_reward_transform_output_feeds_grpo_loss():
    """kl_to_ref of the loss on the transform's output equals kl_to_ref with the reference
    log-probs copied by hand to the loss's default key ("ref_log_probs", "full"), and the
    transform's reference log-probs are really used (a reference equal to the policy gives 0)."""
    tok = make_tokenizer()
    policy = make_tiny_model(tok, dtype=torch.float64)
    reference = make_tiny_model(tok, dtype=torch.float64, seed=1)
    sampler = TransformersWrapper(policy, tok, generate=True, generate_kwargs={
        "max_new_tokens": 6, "generator": torch.Generator().manual_seed(0)})
    td = sampler(chat_batch([p[:1] for p in PROMPTS], key=("history", "prompt")))
    batch = td.shape[0]
    td["next"] = TensorDict({"reward": torch.arange(batch, dtype=torch.float64)[:, None]}, batch_size=td.shape)
    ref = TransformersWrapper(reference, tok, generate=False, log_probs_key="ref_log_probs")
    td = KLRewardTransform(ref, coef=0.1)(td)
    td["advantage"] = torch.linspace(-1, 1, batch, dtype=torch.float64)[:, None]
    actor = TransformersWrapper(policy, tok, generate=False)
    loss = GRPOLoss(actor, kl_to_ref_coeff=0.1, entropy_bonus=False)
    got = loss(td)
    renamed = td.clone()
    renamed["ref_log_probs", "full"] = td["next", "ref_log_prob"]
    want = loss(renamed)
    torch.testing.assert_close(got.kl_to_ref, want.kl_to_ref, rtol=0, atol=0)
    assert float(got.kl_to_ref.abs()) > 1e-4
    same = td.clone()
    same["next", "ref_log_prob"] = td["log_probs", "full"].to(torch.float64)
    assert float(loss(same).kl_to_ref.abs()) < 1e-6
