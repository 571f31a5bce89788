"""RetrieveKL: zero KL for equal weights, full-logit parity, layouts, reuse of sampling
log-probs, gradients, controllers and construction errors."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.helpers import make_tiny_model, make_tokenizer
from tests.llm.naive import MULTI_TURN, PROMPTS, naive_logprobs, rows, token_rows
from tether.control import AdaptiveKLController, ConstantKLController
from tether.llm import RetrieveKL, chat_batch
from tether.models import TransformersWrapper, frozen_copy

REWARD = torch.tensor([[1.0], [-0.5], [2.0]], dtype=torch.float64)


@pytest.fixture
def setup():
    tok = make_tokenizer()
    policy = make_tiny_model(tok, dtype=torch.float64)
    reference = make_tiny_model(tok, dtype=torch.float64, seed=1)
    return tok, policy, reference


def gen_scorer(tok, model, **kw):
    return TransformersWrapper(model, tok, generate=False, **kw)


def ref_scorer(tok, model, **kw):
    return TransformersWrapper(model, tok, generate=False, log_probs_key="ref_log_probs", **kw)


def scored_batch():
    td = chat_batch(MULTI_TURN)
    td["reward"] = REWARD.clone()
    return td


def test_kl_is_zero_for_the_same_weights(setup):
    """A frozen copy of the policy as reference: every per-token KL is exactly 0 and the
    reward is the per-sequence reward on every valid token."""
    tok, policy, _ = setup
    td = RetrieveKL(gen_scorer(tok, policy), ref_scorer(tok, frozen_copy(policy)), coeff=3.0)(scored_batch())
    assert torch.all(td["kl_penalty"] == 0)
    mask = td["masks", "all_attention_mask"]
    assert torch.equal(td["reward"].squeeze(-1), torch.where(mask, REWARD, 0.0))
    # and the reference log-probs really are non-trivial
    assert td["ref_log_probs", "full"][td["masks", "all_assistant_mask"]].lt(-1e-3).any()


def test_matches_plain_torch_kl_and_reward(setup):
    """kl = log_softmax gathered (policy) - same (reference) on the assistant tokens, 1e-10;
    reward = r - 0.25 * kl on every valid token."""
    tok, policy, reference = setup
    td = RetrieveKL(gen_scorer(tok, policy), ref_scorer(tok, reference), coeff=0.25)(scored_batch())
    for b, (ids, asst, kl, rew) in enumerate(zip(
        token_rows(td), rows(td, ("masks", "all_assistant_mask")), rows(td, "kl_penalty"), rows(td, "reward"),
    )):
        expected = torch.where(asst, naive_logprobs(policy, ids) - naive_logprobs(reference, ids), 0.0)
        torch.testing.assert_close(kl, expected, rtol=0, atol=1e-10)
        torch.testing.assert_close(rew.squeeze(-1), REWARD[b] - 0.25 * expected, rtol=0, atol=1e-10)


def test_assistant_only_false_counts_every_scored_token(setup):
    tok, policy, reference = setup
    module = RetrieveKL(gen_scorer(tok, policy), ref_scorer(tok, reference), assistant_only=False, add_to_reward=False)
    td = module(chat_batch(MULTI_TURN))
    for ids, kl in zip(token_rows(td), rows(td, "kl_penalty")):
        expected = naive_logprobs(policy, ids) - naive_logprobs(reference, ids)
        torch.testing.assert_close(kl, expected, rtol=0, atol=1e-10)


def test_layouts_give_identical_results(setup):
    tok, policy, reference = setup
    results = []
    for pad_output in (True, False):
        for side in ("left", "right"):
            module = RetrieveKL(gen_scorer(tok, policy, pad_output=pad_output),
                                ref_scorer(tok, reference, pad_output=pad_output), padding_side=side)
            td = module(scored_batch())
            assert td["kl_penalty"].is_nested == (not pad_output)
            results.append((rows(td, "kl_penalty"), rows(td, "reward")))
    for kl, reward in results[1:]:
        for a, b in zip(kl + reward, results[0][0] + results[0][1]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("pad_output", [True, False])
def test_reusing_sampling_log_probs_equals_recomputation(setup, pad_output):
    """After sampling at temperature 0.8, gen_model=None gives the KL and reward of a
    recomputation with a scorer at the same temperature (float32 sampler: 1e-5), on the
    sampled response only (the multi-turn prompt's earlier assistant turn is excluded)."""
    tok, policy, reference = setup
    sampler = TransformersWrapper(policy, tok, generate=True, temperature=0.8, pad_output=pad_output,
                                  generate_kwargs={"max_new_tokens": 8, "generator": torch.Generator().manual_seed(0)})
    sampled = sampler(chat_batch(PROMPTS, key=("history", "prompt")))
    sampled["reward"] = REWARD.clone()
    ref = ref_scorer(tok, reference, temperature=0.8, pad_output=pad_output)
    reused = RetrieveKL(None, ref)(sampled.clone())
    recomputed = RetrieveKL(gen_scorer(tok, policy, temperature=0.8, pad_output=pad_output), ref)(sampled.clone())
    for key in ("kl_penalty", "reward"):
        for a, b in zip(rows(reused, key), rows(recomputed, key)):
            torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=1e-5)
    responses = [a.sum() for a in rows(reused, ("masks", "all_assistant_mask"))]
    nonzero = [int((k != 0).sum()) for k in rows(reused, "kl_penalty")]
    assert nonzero == [int(n) for n in responses]


def test_detach_controls_the_graph(setup):
    """detach=True: no graph. detach=False: the policy gradient of the summed KL equals
    that of the summed assistant log-probs through full logits; the frozen reference gets none."""
    tok, policy, _ = setup
    reference = frozen_copy(policy)
    td = RetrieveKL(gen_scorer(tok, policy), ref_scorer(tok, reference), add_to_reward=False)(scored_batch())
    assert not td["kl_penalty"].requires_grad
    td = RetrieveKL(gen_scorer(tok, policy), ref_scorer(tok, reference), detach=False,
                    add_to_reward=False)(scored_batch())
    td["kl_penalty"].sum().backward()
    fast = policy.lm_head.weight.grad.clone()
    policy.zero_grad()
    sum(torch.where(a, naive_logprobs(policy, ids), 0.0).sum()
        for ids, a in zip(token_rows(td), rows(td, ("masks", "all_assistant_mask")))).backward()
    torch.testing.assert_close(fast, policy.lm_head.weight.grad, rtol=0, atol=1e-9)
    assert all(p.grad is None for p in reference.parameters())


def test_adaptive_controller_drives_the_coefficient_in_use(setup):
    """beta=0.15, target 6, horizon 1e4, 512 sequences at KL 12 -> 0.151536 (SPEC); the next
    call of the transform charges exactly that coefficient."""
    tok, policy, reference = setup
    module = RetrieveKL(gen_scorer(tok, policy), ref_scorer(tok, reference), coeff=1.0)
    ctl = AdaptiveKLController(init_kl_coef=0.15, target=6.0, horizon=10_000, model=module)
    assert module.kl_coef == 0.15
    ctl.update(torch.full((512,), 12.0))
    assert module.kl_coef == pytest.approx(0.151536, abs=1e-6)
    td = module(scored_batch())
    mask = td["masks", "all_attention_mask"]
    expected = torch.where(mask, REWARD, 0.0) - ctl.kl_coef * td["kl_penalty"]
    torch.testing.assert_close(td["reward"].squeeze(-1), expected, rtol=0, atol=1e-12)
    # the loop a trainer runs: per-sequence summed KL back into the controller
    ctl.update(td["kl_penalty"].sum(-1))
    assert module.kl_coef == ctl.kl_coef


def test_constant_controller_sets_the_coefficient(setup):
    tok, policy, reference = setup
    module = RetrieveKL(gen_scorer(tok, policy), ref_scorer(tok, reference))
    ConstantKLController(kl_coef=0.3, model=module)
    assert module.kl_coef == module.kl_computation.coeff == 0.3


def test_factory_builds_the_reference(setup):
    tok, policy, reference = setup
    direct = RetrieveKL(gen_scorer(tok, policy), ref_scorer(tok, reference))(scored_batch())
    built = RetrieveKL(gen_scorer(tok, policy), ref_model_factory=lambda: ref_scorer(tok, reference))(scored_batch())
    assert torch.equal(direct["kl_penalty"], built["kl_penalty"])


def test_missing_reward_fails_before_any_model_runs(setup):
    tok, policy, reference = setup
    td = chat_batch(MULTI_TURN)
    with pytest.raises(KeyError, match="reward.*add_to_reward=False"):
        RetrieveKL(gen_scorer(tok, policy), ref_scorer(tok, reference))(td)
    assert ("tokens", "full") not in td.keys(True)


def test_missing_sampling_log_probs_with_reuse(setup):
    tok, _, reference = setup
    td = scored_batch()
    with pytest.raises(KeyError, match="log_probs.*full.*Present keys"):
        RetrieveKL(None, ref_scorer(tok, reference))(td)


def test_shape_mismatch_between_sampling_and_reference_log_probs(setup):
    tok, policy, reference = setup
    sampler = TransformersWrapper(policy, tok, generate_kwargs={"max_new_tokens": 4})
    td = sampler(chat_batch(PROMPTS, key=("history", "prompt")))
    td["reward"] = REWARD.clone()
    td["log_probs", "full"] = td["log_probs", "full"][:, :-1]
    with pytest.raises(ValueError, match="all_attention_mask.*shape"):
        RetrieveKL(None, ref_scorer(tok, reference))(td)


def test_construction_errors(setup):
    tok, policy, reference = setup
    gen, ref = gen_scorer(tok, policy), ref_scorer(tok, reference)
    with pytest.raises(ValueError, match="ref_model and ref_model_factory were both given"):
        RetrieveKL(gen, ref, ref_model_factory=lambda: ref)
    with pytest.raises(ValueError, match="ref_model.*got None"):
        RetrieveKL(gen)
    with pytest.raises(TypeError, match="ref_model_factory.*callable"):
        RetrieveKL(gen, ref_model_factory=ref)
    bigger = make_tiny_model(tok, dtype=torch.float64, seed=2)
    bigger.resize_token_embeddings(300)
    with pytest.raises(ValueError, match="vocabulary size mismatch.*260.*300"):
        RetrieveKL(gen, ref_scorer(tok, bigger))
    with pytest.raises(ValueError, match="pad_output mismatch"):
        RetrieveKL(gen, ref_scorer(tok, reference, pad_output=False))
    with pytest.raises(ValueError, match="log_probs_key.*different"):
        RetrieveKL(gen, gen_scorer(tok, reference))
    with pytest.raises(ValueError, match="temperature mismatch"):
        RetrieveKL(gen, ref_scorer(tok, reference, temperature=0.7))
    with pytest.raises(ValueError, match="configured to generate"):
        RetrieveKL(TransformersWrapper(policy, tok), ref)
    with pytest.raises(ValueError, match="configured to generate"):
        RetrieveKL(gen, TransformersWrapper(reference, tok, log_probs_key="ref_log_probs"))
    with pytest.raises(ValueError, match="assistant_only=False with gen_model=None"):
        RetrieveKL(None, ref, assistant_only=False)
    other = make_tokenizer()
    other.add_tokens(["<x>"])
    with pytest.raises(ValueError, match="vocabularies"):
        RetrieveKL(gen, ref, tokenizer=other)
    with pytest.raises(ValueError, match="estimator"):
        RetrieveKL(gen, ref, estimator="kl")
