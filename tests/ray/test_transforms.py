"""RayRetrieveKL and RayKLRewardTransform: parity with the local transforms, named-actor reuse,
a shared coefficient, and construction errors."""

from __future__ import annotations

import functools
import time

import pytest
import ray
import torch
from tensordict import TensorDict

from tests.helpers import make_tiny_model, make_tokenizer
from tests.llm.naive import MULTI_TURN, PROMPTS
from tests.ray.factories import broken_scorer, policy_scorer, reference_scorer
from tether.llm import KLRewardTransform, RetrieveKL, chat_batch
from tether.models import TransformersWrapper
from tether.ray import RayKLRewardTransform, RayNotInitializedError, RayRetrieveKL, ReferenceService

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]

REWARD = torch.tensor([[1.0], [-0.5], [2.0]], dtype=torch.float64)


@pytest.fixture
def started():
    """Ray transforms built by a test; their actors are killed afterwards to free the CPUs."""
    built: list = []
    yield built
    for transform in built:
        transform.shutdown()


def reference_args(how: str) -> dict:
    if how == "model":
        return {"ref_model": reference_scorer()}
    return {"ref_model_factory": functools.partial(reference_scorer)}


def chats_with_reward() -> TensorDict:
    td = chat_batch(MULTI_TURN)
    td["reward"] = REWARD.clone()
    return td


def sampled_with_reward() -> TensorDict:
    """A batch sampled by the float64 tiny policy, with a per-sequence reward under "next"."""
    tok = make_tokenizer()
    sampler = TransformersWrapper(make_tiny_model(tok, dtype=torch.float64), tok, generate_kwargs={
        "max_new_tokens": 6, "generator": torch.Generator().manual_seed(1)})
    td = sampler(chat_batch(PROMPTS, key=("history", "prompt")))
    td["next"] = TensorDict({"reward": REWARD.clone()}, batch_size=[3])
    return td


def assert_same_entries(remote: TensorDict, local: TensorDict, keys) -> None:
    for key in keys:
        got, want = remote.get(key), local.get(key)
        assert got.device == want.device
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("how", ["model", "factory"])
def test_ray_retrieve_kl_matches_the_local_transform(how, started):
    """Same chats, same float64 models: KL, shaped reward and both log-probs agree within 1e-6
    (and the KL is far from 0, so agreement is not trivial)."""
    local = RetrieveKL(policy_scorer(), reference_scorer(), coeff=0.25)(chats_with_reward())
    remote_module = RayRetrieveKL(policy_scorer(), coeff=0.25, **reference_args(how))
    started.append(remote_module)
    remote = remote_module(chats_with_reward())
    assert set(remote.keys(True, True)) == set(local.keys(True, True))
    assert_same_entries(remote, local, ["kl_penalty", "reward", ("ref_log_probs", "full"), ("log_probs", "full"),
                                        ("tokens", "full"), ("masks", "all_assistant_mask")])
    assert local["kl_penalty"].abs().max() > 0.1
    assert remote_module.in_keys == RetrieveKL(policy_scorer(), reference_scorer()).in_keys


def test_ray_kl_reward_matches_the_local_transform(started):
    """Reference shipped as a built model: on a sampled batch, reference log-probs, KL and
    r - 0.5 * kl under "next" agree with the local transform within 1e-6; a missing reward
    raises the local transform's KeyError."""
    local = KLRewardTransform(reference_scorer(), coef=0.5)(sampled_with_reward())
    remote_module = RayKLRewardTransform(reference_scorer(), coef=0.5)
    started.append(remote_module)
    remote = remote_module(sampled_with_reward())
    assert set(remote["next"].keys()) == {"reward", "kl_penalty", "ref_log_prob"}
    assert_same_entries(remote, local, [("next", "reward"), ("next", "kl_penalty"), ("next", "ref_log_prob")])
    assert local["next", "kl_penalty"].abs().max() > 0.1
    assert remote_module.out_keys == ["reward", "kl_penalty", "ref_log_prob"]
    missing = sampled_with_reward()
    del missing["next", "reward"]
    with pytest.raises(KeyError, match="'reward'.*add_to_reward=False"):  # the local error, raised remotely
        remote_module(missing)


def test_named_factory_actor_matches_local_is_reused_and_builds_once(tmp_path, started):
    """Reference built by a factory in the actor (remote device="cpu"): values equal the local
    transform's (1e-6). A second transform with the same actor_name finds that actor: same
    actor id, the factory ran once (one pid logged), the existing settings win, and a
    coefficient set through one is seen and used by the other. Neither a RetrieveKL nor a
    ReferenceService can take over the name."""
    log = tmp_path / "builds.txt"
    factory = functools.partial(reference_scorer, log_path=str(log))
    first = RayKLRewardTransform(ref_model_factory=factory, actor_name="tether-test-kl", coef=0.5, device="cpu")
    started.append(first)
    local = KLRewardTransform(reference_scorer(), coef=0.5)(sampled_with_reward())
    assert_same_entries(first(sampled_with_reward()), local,
                        [("next", "reward"), ("next", "kl_penalty"), ("next", "ref_log_prob")])
    second = RayKLRewardTransform(ref_model_factory=factory, actor_name="tether-test-kl", coef=9.0)
    assert second.actor_id == first.actor_id
    assert (first.created_actor, second.created_actor) == (True, False)
    assert len(log.read_text().splitlines()) == 1
    assert second.kl_coef == 0.5
    second.coef = 0.25
    assert first.kl_coef == 0.25
    expected = KLRewardTransform(reference_scorer(), coef=0.25)(sampled_with_reward())
    assert_same_entries(first(sampled_with_reward()), expected, [("next", "reward")])
    with pytest.raises(TypeError, match="hosts a KLRewardTransform, not a RetrieveKL"):
        RayRetrieveKL(ref_model_factory=factory, actor_name="tether-test-kl")
    with pytest.raises(TypeError, match="'tether-test-kl': that actor is not a ReferenceService"):
        ReferenceService(ref_model_factory=factory, actor_name="tether-test-kl")
    with pytest.raises(ValueError, match="kl_coef"):
        second.kl_coef = -1.0
    assert len(log.read_text().splitlines()) == 1


def test_a_failing_factory_is_reported_at_construction():
    """The factory runs in the actor; its error comes back from the constructor, not the first batch."""
    with pytest.raises(ray.exceptions.ActorDiedError, match="FileNotFoundError: no such model"):
        RayKLRewardTransform(ref_model_factory=broken_scorer, num_cpus=0.5)


def test_an_actor_that_cannot_be_placed_is_refused_at_once_and_removed():
    """One GPU asked of this CPU cluster (the GPU example of docs/scaling.md on a CPU machine): Ray
    would keep the actor pending for ever. The constructor refuses at once, not after the 300 s
    default ready_timeout_s, naming what was asked and what the cluster has, and kills the actor
    it created: its name is free again. Timeouts that are not finite numbers > 0 are refused
    before any actor."""
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"RayKLRewardTransform: the actor asked for .*'num_gpus': 1.0.*could never "
                                         r"be placed.*num_gpus=0, device='cpu'"):
        RayKLRewardTransform(ref_model_factory=reference_scorer, num_gpus=1, actor_name="tether-test-gpu")
    assert time.monotonic() - start < 60
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "tether-test-gpu" in ray.util.list_named_actors():
        time.sleep(0.1)
    assert "tether-test-gpu" not in ray.util.list_named_actors()
    with pytest.raises(ValueError, match="timeout_s: expected a finite number > 0, got -1"):
        RayRetrieveKL(ref_model_factory=reference_scorer, timeout_s=-1)
    with pytest.raises(ValueError, match="ready_timeout_s: expected a finite number > 0, got nan"):
        RayKLRewardTransform(ref_model_factory=reference_scorer, ready_timeout_s=float("nan"))


@pytest.mark.parametrize("cls", [RayKLRewardTransform, RayRetrieveKL, ReferenceService])
def test_model_arguments_are_checked_before_any_actor(cls):
    ref = reference_scorer()
    with pytest.raises(ValueError, match="ref_model and ref_model_factory were both given.*drop ref_model"):
        cls(ref_model=ref, ref_model_factory=reference_scorer)
    with pytest.raises(ValueError, match="ref_model / ref_model_factory: expected exactly one, got neither"):
        cls()
    with pytest.raises(TypeError, match="ref_model_factory: expected a callable.*got TransformersWrapper"):
        cls(ref_model_factory=ref)
    with pytest.raises(TypeError, match="ref_model: expected a tether.models.TransformersWrapper"):
        cls(ref_model=ref.model)
    with pytest.raises(ValueError, match="device='cuda'.*num_gpus=1"):
        cls(ref_model_factory=reference_scorer, device="cuda")


def test_keyword_errors():
    with pytest.raises(TypeError, match=r"\['coeff'\]: not keyword arguments of KLRewardTransform.*'coef'"):
        RayKLRewardTransform(ref_model_factory=reference_scorer, coeff=0.1)
    with pytest.raises(ValueError, match="detach=False"):
        RayRetrieveKL(ref_model_factory=reference_scorer, detach=False)
    with pytest.raises(ValueError, match="gen_model and gen_model_factory were both given"):
        RayRetrieveKL(policy_scorer(), ref_model_factory=reference_scorer, gen_model_factory=policy_scorer)
    with pytest.raises(ValueError, match="num_cpus: expected a finite number >= 0"):
        RayKLRewardTransform(ref_model_factory=reference_scorer, num_cpus=-1)
    with pytest.raises(TypeError, match="actor_name: expected a non-empty string"):
        RayKLRewardTransform(ref_model_factory=reference_scorer, actor_name="")


def test_an_uninitialised_ray_is_reported_not_started(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RayNotInitializedError, match=r"RayKLRewardTransform: Ray is not initialised.*ray.init\("):
        RayKLRewardTransform(ref_model_factory=reference_scorer)
    with pytest.raises(RayNotInitializedError, match="ReferenceService"):
        ReferenceService(ref_model_factory=reference_scorer)
