"""tether.integrations.torchrl: the seed's Pendulum-v1 example inside a TorchRL TransformedEnv.

TorchRL lives in an environment of its own (``make torchrl-env``): these tests skip without it,
except the ones that check the ImportError a user gets when it is missing and that no extra of
the main environment would install it.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.transforms.test_kl_reward import independent_log_prob, make_actor, shift, weights
from tether.transforms import KLRewardTransform


def test_missing_torchrl_gives_an_install_hint(monkeypatch):
    from tether.integrations import torchrl as bridge

    bridge._env_transform_class.cache_clear()
    monkeypatch.setitem(sys.modules, "torchrl", None)  # makes `import torchrl...` fail
    monkeypatch.setitem(sys.modules, "torchrl.data.tensor_specs", None)
    monkeypatch.setitem(sys.modules, "torchrl.envs.transforms.transforms", None)
    transform = KLRewardTransform(make_actor("gaussian"))
    with pytest.raises(ImportError, match=r"pins tensordict 0\.14.*`make torchrl-env` builds \.venv-bench"):
        bridge.as_env_transform(transform)
    bridge._env_transform_class.cache_clear()


def test_no_extra_of_the_main_environment_installs_torchrl():
    """TorchRL 0.14.1 (the newest on the registry) pins tensordict 0.14, so an extra that pulled it
    into the main environment would move tensordict 0.15 back (#27 item 4). Only the bench extra,
    which `make torchrl-env` / `make bench` install into .venv-bench, may name it."""
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pulls = sorted(name for name, reqs in extras.items() if any(r.lower().startswith("torchrl") for r in reqs))
    assert pulls == ["bench"]
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    assert "torchrl-env: $(BENCH_STAMP)" in makefile and 'pip install -q -e ".[test,bench,peft]"' in makefile


def test_as_env_transform_refuses_other_objects():
    pytest.importorskip("torchrl")
    from tether.integrations.torchrl import as_env_transform

    with pytest.raises(TypeError, match="KLRewardTransform"):
        as_env_transform(torch.nn.Identity())


@pytest.mark.parametrize("out_key", ["reward_kl", "reward"])
def test_pendulum_transformed_env_penalises_every_step(out_key):
    """Seed example: transform built, then actor parameters shifted by +1, then a 3-step
    rollout. Each step's reward is raw - coef * (log pi_now(a) - log pi_0(a)), recomputed by
    hand from the original and shifted weights."""
    pytest.importorskip("torchrl")
    pytest.importorskip("gymnasium")
    from torchrl.data.tensor_specs import Unbounded
    from torchrl.envs import TransformedEnv
    from torchrl.envs.libs.gym import GymEnv

    from tether.integrations.torchrl import as_env_transform

    actor = make_actor("tanh", log_prob_key="sample_log_prob", dtype=torch.float32)
    w0, b0 = weights(actor)
    transform = KLRewardTransform(actor, coef=0.3, out_keys=out_key, kl_key="kl")
    base = GymEnv("Pendulum-v1")
    env = TransformedEnv(base, as_env_transform(transform))
    env.set_seed(0)
    if out_key == "reward":
        assert isinstance(env.full_reward_spec["reward"], Unbounded)
    else:
        assert env.full_observation_spec[out_key].shape == env.full_reward_spec["reward"].shape
    shift(actor, 1.0)
    w1, b1 = weights(actor)
    with torch.no_grad():
        td = env.rollout(3, actor)
    env.close()

    obs, action = td["observation"].double(), td["action"].double()
    log_ratio = (independent_log_prob("tanh", w1.double(), b1.double(), obs, action)
                 - independent_log_prob("tanh", w0.double(), b0.double(), obs, action))
    torch.testing.assert_close(td["next", "kl"].double(), log_ratio, rtol=1e-4, atol=1e-4)
    # Pendulum's own reward, from the state the action was taken in (gymnasium's formula):
    # -(theta^2 + 0.1 * theta_dot^2 + 0.001 * u^2), theta = atan2(sin, cos) in [-pi, pi].
    theta = torch.atan2(obs[..., 1:2], obs[..., 0:1])
    raw = -(theta**2 + 0.1 * obs[..., 2:3] ** 2 + 0.001 * action.clamp(-2, 2) ** 2)
    if out_key != "reward":
        torch.testing.assert_close(td["next", "reward"].double(), raw, rtol=1e-5, atol=1e-5)
    adjusted = td["next", out_key].double()
    assert (adjusted != raw).all()
    torch.testing.assert_close(adjusted, raw - 0.3 * log_ratio, rtol=1e-4, atol=1e-4)
    assert torch.all((adjusted < raw) == (log_ratio > 0))
