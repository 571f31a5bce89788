"""KLRewardTransform against log-ratios computed independently with torch.distributions.

The actors are a linear layer followed by a NormalParamExtractor (loc, scale) and either a
Normal or a tanh-squashed Normal. The independent reference recomputes loc and scale from
the weights by hand and the log-density with torch.distributions (tanh change of variables
written out: log p(a) = log N(atanh a; loc, scale) - log(1 - a^2)), never through the
transform's functional copy.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import InteractionType, NormalParamExtractor
from tensordict.nn import ProbabilisticTensorDictModule as ProbModule
from tensordict.nn import ProbabilisticTensorDictSequential as ProbSequential
from tensordict.nn import TensorDictModule
from torch import distributions as D
from torch import nn
from torch.nn import functional as F

from tether.transforms import KLRewardTransform

OBS, ACT = 3, 1


class TanhNormal(D.TransformedDistribution):
    """Normal squashed by tanh; ``cache_size=1`` so a sample's log-prob uses its pre-image."""

    def __init__(self, loc: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__(D.Normal(loc, scale), [D.TanhTransform(cache_size=1)])


class IndependentNormal(D.Independent):
    """Normal over a vector action whose log-prob sums the action dimensions."""

    def __init__(self, loc: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__(D.Normal(loc, scale), 1)


# kind -> (distribution class, NormalParamExtractor scale mapping, independent scale map)
KINDS = {
    "gaussian": (D.Normal, "exp", torch.exp),
    "tanh": (TanhNormal, "softplus", F.softplus),
    "independent": (IndependentNormal, "exp", torch.exp),
}


def make_actor(kind: str, *, act_dim: int = ACT, log_prob_key=None, dtype=torch.float64):
    dist_class, mapping, _ = KINDS[kind]
    net = TensorDictModule(
        nn.Sequential(nn.Linear(OBS, 2 * act_dim), NormalParamExtractor(scale_mapping=mapping)),
        in_keys=["observation"], out_keys=["loc", "scale"],
    )
    with torch.no_grad():  # small weights keep tanh samples away from +-1
        for param in net.parameters():
            param.mul_(0.5)
    head = ProbModule(
        in_keys=["loc", "scale"], out_keys=["action"], distribution_class=dist_class,
        return_log_prob=True, log_prob_key=log_prob_key,
        default_interaction_type=InteractionType.RANDOM,
    )
    return ProbSequential(net, head).to(dtype)


def linear_of(actor) -> nn.Linear:
    return actor.module[0].module[0]


def weights(actor) -> tuple[torch.Tensor, torch.Tensor]:
    layer = linear_of(actor)
    return layer.weight.detach().clone(), layer.bias.detach().clone()


def independent_log_prob(kind, weight, bias, obs, action):
    """log pi(action | obs) from the weights, with loc/scale and the density written out."""
    _, _, scale_map = KINDS[kind]
    loc, raw = (obs @ weight.T + bias).chunk(2, -1)
    scale = scale_map(raw).clamp_min(1e-4)
    if kind == "tanh":
        return D.Normal(loc, scale).log_prob(torch.atanh(action)) - torch.log1p(-action.pow(2))
    log_prob = D.Normal(loc, scale).log_prob(action)
    return log_prob.sum(-1) if kind == "independent" else log_prob


def rollout(actor, batch=(2, 5), *, dtype=torch.float64):
    """A rollout of ``actor``: observation, action, log-prob, and ("next", "reward") [*batch, 1]."""
    td = TensorDict(observation=torch.randn(*batch, OBS, dtype=dtype), batch_size=batch)
    with torch.no_grad():
        actor(td)
    td["next"] = TensorDict(reward=torch.randn(*batch, 1, dtype=dtype), batch_size=batch)
    return td


def shift(actor, amount) -> None:
    with torch.no_grad():
        for param in actor.parameters():
            param.add_(amount)


@pytest.mark.parametrize("kind", list(KINDS))
def test_penalty_is_exactly_zero_right_after_construction(kind):
    actor = make_actor(kind, act_dim=2 if kind == "independent" else ACT)
    transform = KLRewardTransform(actor, coef=0.7, kl_key="kl")
    td = rollout(actor)
    out = transform(td.clone())
    # The rollout's tanh log-prob used the sample's cached pre-image; the frozen copy maps the
    # action back with atanh, which rounds differently in the last bit (float64).
    tol = 1e-13 if kind == "tanh" else 0.0
    torch.testing.assert_close(out["next", "kl"], torch.zeros_like(td["next", "reward"]), rtol=0, atol=tol)
    torch.testing.assert_close(out["next", "reward"], td["next", "reward"], rtol=0, atol=tol)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("coef", [0.0, 0.35, 2.0])
def test_penalty_matches_independent_log_ratio_after_the_actor_moves(kind, coef):
    """reward_kl = reward - coef * (log pi_now(a) - log pi_0(a)), per element and with the
    sign of a penalty: lower where the current policy is more likely than the frozen one."""
    act_dim = 2 if kind == "independent" else ACT
    actor = make_actor(kind, act_dim=act_dim)
    w0, b0 = weights(actor)
    transform = KLRewardTransform(actor, coef=coef, out_keys="reward_kl", kl_key="kl")
    with torch.no_grad():
        linear_of(actor).weight.add_(0.3 * torch.randn_like(w0))
        linear_of(actor).bias.add_(0.3 * torch.randn_like(b0))
    w1, b1 = weights(actor)
    td = rollout(actor, batch=(4, 6))
    obs, action = td["observation"], td["action"]
    now = independent_log_prob(kind, w1, b1, obs, action)
    frozen = independent_log_prob(kind, w0, b0, obs, action)
    torch.testing.assert_close(td[actor.log_prob_key], now, rtol=1e-9, atol=1e-9)
    log_ratio = (now - frozen).reshape(td["next", "reward"].shape)
    assert (log_ratio > 0).any() and (log_ratio < 0).any()  # both signs are exercised

    out = transform(td.clone())
    reward, adjusted = td["next", "reward"], out["next", "reward_kl"]
    torch.testing.assert_close(out["next", "kl"], log_ratio, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(adjusted, reward - coef * log_ratio, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out["next", "reward"], reward, rtol=0, atol=0)  # raw kept
    if coef > 0:
        assert torch.all((adjusted < reward) == (log_ratio > 0))


def test_live_policy_entries_in_the_rollout_are_left_alone():
    actor = make_actor("gaussian")
    transform = KLRewardTransform(actor)
    shift(actor, 0.5)
    td = rollout(actor)
    out = transform(td.clone())
    for key in ("loc", "scale", "action", actor.log_prob_key, "observation"):
        assert torch.equal(out[key], td[key])


def test_frozen_copy_does_not_follow_optimizer_steps():
    actor = make_actor("tanh")
    w0, b0 = weights(actor)
    transform = KLRewardTransform(actor, coef=1.0, kl_key="kl")
    optimizer = torch.optim.SGD(actor.parameters(), lr=0.5)
    td = rollout(actor)
    for _ in range(3):
        optimizer.zero_grad()
        loss = -actor.get_dist(td.select("observation")).log_prob(td["action"]).mean()
        loss.backward()
        optimizer.step()
    w1, b1 = weights(actor)
    assert not torch.allclose(w1, w0)
    frozen = transform.frozen_params
    assert torch.equal(frozen["module", "0", "module", "0", "weight"], w0)
    assert torch.equal(frozen["module", "0", "module", "0", "bias"], b0)
    live = {p.data_ptr() for p in actor.parameters()}
    assert live.isdisjoint(t.data_ptr() for t in frozen.values(True, True))

    td = rollout(actor)
    expected = independent_log_prob("tanh", w1, b1, td["observation"], td["action"]) - (
        independent_log_prob("tanh", w0, b0, td["observation"], td["action"])
    )
    torch.testing.assert_close(transform(td)["next", "kl"], expected, rtol=1e-9, atol=1e-9)


def test_requires_grad_snapshot_follows_dtype_and_receives_gradients():
    """With requires_grad=True the snapshot is a pair of parameters of the transform; after
    .to(float64) the gradient of sum(reward_kl) w.r.t. them equals the gradient of
    sum(reward - coef * (log pi_now - log pi_0(w0, b0))) computed by hand with w0, b0 as leaves."""
    actor = make_actor("gaussian", dtype=torch.float32)
    transform = KLRewardTransform(actor, coef=0.4, requires_grad=True)
    assert [p.dtype for p in transform.parameters()] == [torch.float32] * 2
    transform.to(torch.float64)
    params = dict(transform.named_parameters())
    assert len(params) == 2 and all(p.dtype == torch.float64 for p in params.values())
    w0 = params["frozen_params.module.0.module.0.weight"]
    b0 = params["frozen_params.module.0.module.0.bias"]

    shift(actor, 0.2)
    actor.to(torch.float64)
    td = rollout(actor)
    out = transform(td.clone())
    out["next", "reward"].sum().backward()

    w_ref, b_ref = w0.detach().clone().requires_grad_(), b0.detach().clone().requires_grad_()
    frozen = independent_log_prob("gaussian", w_ref, b_ref, td["observation"], td["action"])
    expected = (td["next", "reward"] - 0.4 * (td[actor.log_prob_key] - frozen)).sum()
    expected.backward()
    torch.testing.assert_close(out["next", "reward"].sum(), expected.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(w0.grad, w_ref.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(b0.grad, b_ref.grad, rtol=1e-10, atol=1e-12)
    assert all(p.grad is None for p in actor.parameters())


def test_default_snapshot_is_buffers_that_follow_dtype_and_carry_no_graph():
    actor = make_actor("gaussian", dtype=torch.float32)
    transform = KLRewardTransform(actor, coef=0.4)
    assert list(transform.parameters()) == []
    buffers = dict(transform.named_buffers())
    assert len(buffers) == 2 and all(b.dtype == torch.float32 for b in buffers.values())
    transform.to(torch.float64)
    assert all(b.dtype == torch.float64 for b in transform.buffers())
    actor.to(torch.float64)
    shift(actor, 0.2)
    out = transform(rollout(actor))
    assert not out["next", "reward"].requires_grad


def test_batch_norm_buffers_are_frozen_and_used_in_eval_mode():
    """The snapshot includes buffers: running statistics the live actor accumulates later are
    not seen by the frozen copy, and the frozen copy never updates its own."""
    net = TensorDictModule(
        nn.Sequential(nn.Linear(OBS, 2), nn.BatchNorm1d(2), NormalParamExtractor("exp")),
        in_keys=["observation"], out_keys=["loc", "scale"],
    )
    head = ProbModule(in_keys=["loc", "scale"], out_keys=["action"],
                      distribution_class=D.Normal, return_log_prob=True,
                      default_interaction_type=InteractionType.RANDOM)
    actor = ProbSequential(net, head).double()
    transform = KLRewardTransform(actor, kl_key="kl")
    snapshot = transform.frozen_params.clone()
    actor.train()
    td = rollout(actor, batch=(16,))  # train mode: updates the live running stats
    out = transform(td.clone())
    assert all(torch.equal(a, b) for a, b in zip(snapshot.values(True, True),
                                                  transform.frozen_params.values(True, True)))
    bn = actor.module[0].module[1]
    assert not torch.equal(bn.running_mean, snapshot["module", "0", "module", "1", "running_mean"])
    # eval-mode reference with the snapshot statistics, by hand
    layer = linear_of(actor)
    h = td["observation"] @ layer.weight.detach().T + layer.bias.detach()
    mean = snapshot["module", "0", "module", "1", "running_mean"]
    var = snapshot["module", "0", "module", "1", "running_var"]
    h = (h - mean) / torch.sqrt(var + bn.eps) * bn.weight.detach() + bn.bias.detach()
    loc, raw = h.chunk(2, -1)
    frozen = D.Normal(loc, raw.exp().clamp_min(1e-4)).log_prob(td["action"])
    torch.testing.assert_close(out["next", "kl"], td[actor.log_prob_key] - frozen,
                               rtol=1e-9, atol=1e-9)


def test_reward_at_the_root_and_trailing_one_shapes():
    """No "next": the reward is read and written at the root. A [B] reward with [B, 1]
    log-probs and a [B, 1] reward with [B] log-probs (Independent) both keep the reward shape."""
    actor = make_actor("gaussian")
    w0, b0 = weights(actor)
    transform = KLRewardTransform(actor, coef=0.5, out_keys="penalised")
    shift(actor, 0.3)
    td = rollout(actor, batch=(7,)).exclude("next")
    td["reward"] = torch.randn(7, dtype=torch.float64)
    out = transform(td.clone())
    log_ratio = (td[actor.log_prob_key]
                 - independent_log_prob("gaussian", w0, b0, td["observation"], td["action"]))
    assert out["penalised"].shape == (7,)
    torch.testing.assert_close(out["penalised"], td["reward"] - 0.5 * log_ratio.squeeze(-1))

    vector = make_actor("independent", act_dim=2)
    transform = KLRewardTransform(vector, coef=0.5)
    shift(vector, 0.3)
    td = rollout(vector, batch=(7,))
    assert td[vector.log_prob_key].shape == (7,)
    assert transform(td.clone())["next", "reward"].shape == (7, 1)


def test_explicit_next_key_and_custom_log_prob_key():
    actor = make_actor("gaussian", log_prob_key="sample_log_prob")
    transform = KLRewardTransform(actor, in_keys=[("next", "reward")],
                                  out_keys=("next", "reward_kl"))
    assert transform.log_prob_key == "sample_log_prob" and transform.action_key == "action"
    shift(actor, 0.3)
    td = rollout(actor)
    assert "sample_log_prob" in td.keys()
    out = transform(td.clone())
    assert not torch.equal(out["next", "reward_kl"], td["next", "reward"])
    # a relative reward key with an explicit ("next", ...) kl key: no doubled "next"
    relative = KLRewardTransform(actor, kl_key=("next", "kl"))
    relative.load_state_dict(transform.state_dict())
    out = relative(td.clone())
    assert set(out["next"].keys()) == {"reward", "kl"}
    torch.testing.assert_close(out["next", "reward"], td["next", "reward"] - out["next", "kl"])


def test_kl_coef_is_a_read_write_alias_of_coef():
    actor = make_actor("gaussian")
    transform = KLRewardTransform(actor, coef=1.0, kl_key="kl")
    transform.kl_coef = 0.25
    assert transform.coef == 0.25 and type(transform.kl_coef) is float
    shift(actor, 0.3)
    td = rollout(actor)
    reward = td["next", "reward"].clone()
    out = transform(td)
    assert (out["next", "kl"] != 0).all()
    torch.testing.assert_close(out["next", "reward"], reward - 0.25 * out["next", "kl"])
    with pytest.raises(ValueError, match="coef"):
        transform.kl_coef = -1.0
    with pytest.raises(TypeError, match="coef"):
        transform.kl_coef = "0.1"


@pytest.mark.parametrize(
    ("drop", "needle"),
    [
        (("next", "reward"), "reward"),
        ("action", "action"),
        ("action_log_prob", "action_log_prob"),
        ("observation", "observation"),
    ],
)
def test_missing_keys_raise_key_error_naming_them(drop, needle):
    actor = make_actor("gaussian")
    transform = KLRewardTransform(actor)
    td = rollout(actor).exclude(drop)
    with pytest.raises(KeyError, match=needle) as info:
        transform(td)
    assert "Present keys" in str(info.value)


def test_constructor_and_shape_errors():
    actor = make_actor("gaussian")
    with pytest.raises(TypeError, match="actor"):
        KLRewardTransform(nn.Linear(3, 2))
    with pytest.raises(ValueError, match="in_keys"):
        KLRewardTransform(actor, in_keys=["reward", "other"])
    with pytest.raises(TypeError, match="out_keys"):
        KLRewardTransform(actor, out_keys=3)
    with pytest.raises(ValueError, match="coef"):
        KLRewardTransform(actor, coef=float("nan"))
    transform = KLRewardTransform(actor)
    td = rollout(actor)
    td["next", "reward"] = torch.zeros(2, 5, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="Independent"):
        transform(td)


def test_pendulum_rollout_in_the_seed_layout():
    """The seed's Pendulum-v1 example without TorchRL: a 4-step gymnasium rollout of a
    tanh-Gaussian actor whose parameters were shifted by +1 after the transform was built.
    Every adjusted reward differs from the raw one, by -coef * (log pi_now - log pi_0)."""
    gymnasium = pytest.importorskip("gymnasium")
    actor = make_actor("tanh", log_prob_key="sample_log_prob")
    w0, b0 = weights(actor)
    transform = KLRewardTransform(actor, coef=0.3, out_keys="reward_kl")
    shift(actor, 1.0)
    w1, b1 = weights(actor)

    env = gymnasium.make("Pendulum-v1")
    obs, _ = env.reset(seed=0)
    steps = []
    for _ in range(4):
        step = TensorDict(observation=torch.as_tensor(obs, dtype=torch.float64))
        with torch.no_grad():
            actor(step)
        obs, reward, terminated, truncated, _ = env.step(step["action"].numpy())
        step["next"] = TensorDict(
            observation=torch.as_tensor(obs, dtype=torch.float64),
            reward=torch.tensor([float(reward)], dtype=torch.float64),
            done=torch.tensor([terminated or truncated]),
        )
        steps.append(step)
    env.close()
    td = torch.stack(steps)
    assert td.batch_size == (4,) and td["next", "reward"].shape == (4, 1)

    out = transform(td.clone())
    raw, adjusted = td["next", "reward"], out["next", "reward_kl"]
    assert (adjusted != raw).all()
    now = independent_log_prob("tanh", w1, b1, td["observation"], td["action"])
    frozen = independent_log_prob("tanh", w0, b0, td["observation"], td["action"])
    torch.testing.assert_close(adjusted, raw - 0.3 * (now - frozen), rtol=1e-7, atol=1e-7)
    assert torch.all((adjusted < raw) == (now > frozen))
