"""LLM KLRewardTransform: reference log-probs, k1 penalty on the reward, keys and errors."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.helpers import make_tiny_model, make_tokenizer
from tests.llm.naive import PROMPTS, naive_logprobs, rows, token_rows
from tether.control import AdaptiveKLController
from tether.llm import KLRewardTransform, chat_batch
from tether.models import TransformersWrapper

REWARD = torch.tensor([[1.0], [0.0], [-2.0]], dtype=torch.float64)


@pytest.fixture
def sampled():
    """A batch sampled from the policy, with a per-sequence reward under "next"."""
    tok = make_tokenizer()
    policy = make_tiny_model(tok, dtype=torch.float64)
    reference = make_tiny_model(tok, dtype=torch.float64, seed=1)
    sampler = TransformersWrapper(policy, tok, generate_kwargs={"max_new_tokens": 6,
                                                                "generator": torch.Generator().manual_seed(1)})
    td = sampler(chat_batch(PROMPTS, key=("history", "prompt")))
    td["next"] = TensorDict({"reward": REWARD.clone()}, batch_size=[3])
    ref = TransformersWrapper(reference, tok, generate=False, log_probs_key="ref_log_probs")
    return td, ref, reference


def expected_kl(td, reference):
    """k1 = sampling log-prob - full-logit reference log-prob on the sampled response."""
    mask = td["masks", "all_attention_mask"]
    out = []
    for ids, lp, asst, m in zip(token_rows(td), td["log_probs", "full"], td["masks", "all_assistant_mask"], mask):
        ref = naive_logprobs(reference, ids)
        out.append((torch.where(asst[m], lp[m].double() - ref, 0.0), torch.where(asst[m], ref, 0.0)))
    return out


def test_writes_reference_log_probs_kl_and_penalised_reward(sampled):
    """next: ref_log_prob = reference log-probs on the response, kl_penalty = sampling minus
    reference, reward = r - 0.5 * kl on every valid token (1e-10, float64 reference)."""
    td, ref, reference = sampled
    td = KLRewardTransform(ref, coef=0.5)(td)
    nxt, mask = td["next"], td["masks", "all_attention_mask"]
    for b, (kl, ref_lp) in enumerate(expected_kl(td, reference)):
        torch.testing.assert_close(nxt["kl_penalty"][b][mask[b]], kl, rtol=0, atol=1e-10)
        torch.testing.assert_close(nxt["ref_log_prob"][b][mask[b]], ref_lp, rtol=0, atol=1e-10)
        torch.testing.assert_close(nxt["reward"][b][mask[b]].squeeze(-1), REWARD[b] - 0.5 * kl, rtol=0, atol=1e-10)
    assert "kl_penalty" not in td.exclude("next").keys()


def test_missing_reward_is_a_clear_error_before_scoring(sampled):
    td, ref, _ = sampled
    del td["next", "reward"]
    with pytest.raises(KeyError, match="'reward'.*add_to_reward=False"):
        KLRewardTransform(ref)(td)
    assert "ref_log_prob" not in td["next"].keys()
    td = KLRewardTransform(ref, add_to_reward=False)(td)
    assert set(td["next"].keys()) == {"kl_penalty", "ref_log_prob"}


def test_missing_policy_log_probs(sampled):
    td, ref, _ = sampled
    del td["log_probs"]
    with pytest.raises(KeyError, match=r"\('log_probs', 'full'\).*Present keys"):
        KLRewardTransform(ref)(td)


def test_custom_keys(sampled):
    td, ref, reference = sampled
    td["next", "score"] = td["next"].pop("reward")
    module = KLRewardTransform(ref, coef=2.0, in_keys=["score"], out_keys=["shaped", "kl", "ref_lp"])
    td = module(td)
    mask = td["masks", "all_attention_mask"]
    for b, (kl, _) in enumerate(expected_kl(td, reference)):
        torch.testing.assert_close(td["next", "shaped"][b][mask[b]].squeeze(-1), REWARD[b] - 2.0 * kl,
                                   rtol=0, atol=1e-10)
    assert torch.equal(td["next", "score"], REWARD)
    assert module.out_keys == ["shaped", "kl", "ref_lp"]


def test_controller_drives_the_coefficient(sampled):
    td, ref, reference = sampled
    module = KLRewardTransform(ref, coef=1.0)
    ctl = AdaptiveKLController(init_kl_coef=0.15, target=6.0, horizon=10_000, model=module)
    ctl.update(torch.full((512,), 3.0))
    assert module.kl_coef == module.coef == pytest.approx(0.148464, abs=1e-6)
    td = module(td)
    mask = td["masks", "all_attention_mask"]
    for b, (kl, _) in enumerate(expected_kl(td, reference)):
        torch.testing.assert_close(td["next", "reward"][b][mask[b]].squeeze(-1), REWARD[b] - ctl.kl_coef * kl,
                                   rtol=0, atol=1e-10)


def test_construction_errors(sampled):
    _, ref, reference = sampled
    with pytest.raises(ValueError, match="both given"):
        KLRewardTransform(ref, ref_model_factory=lambda: ref)
    with pytest.raises(ValueError, match="configured to generate"):
        KLRewardTransform(TransformersWrapper(reference, make_tokenizer()))
    with pytest.raises(ValueError, match="in_keys.*exactly one"):
        KLRewardTransform(ref, in_keys=["a", "b"])
    with pytest.raises(ValueError, match="out_keys.*one key.*or three"):
        KLRewardTransform(ref, out_keys=["a", "b"])
    with pytest.raises(ValueError, match="coef|kl_coef"):
        KLRewardTransform(ref, coef=-1.0)
    assert isinstance(KLRewardTransform(ref_model_factory=lambda: ref).ref_log_prob.model, TransformersWrapper)
