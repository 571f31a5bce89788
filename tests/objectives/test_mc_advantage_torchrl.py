"""MCAdvantage inside a real TorchRL ReplayBuffer (bench environment; skips without TorchRL).

A buffer runs a TorchRL transform's inverse on ``extend`` and its forward on ``sample``; a
plain callable is wrapped so that its write path is the identity.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from tether.models.batch_io import write_objects
from tether.objectives import MCAdvantage

EPS = 1e-6  # added to the group spread by grpo


def one_step_trajectories(prompts, rewards):
    """Single-turn LLM trajectories: one done step each, scalar reward [1]."""
    n = len(prompts)
    td = TensorDict(
        {("next", "reward"): torch.tensor(rewards, dtype=torch.float64).reshape(n, 1),
         ("next", "done"): torch.ones(n, 1, dtype=torch.bool)},
        batch_size=[n],
    )
    write_objects(td, "text", prompts)
    return td


def test_wrapped_mc_advantage_writes_advantages_through_extend():
    """Prompts a, b, a, b with rewards 1, 3, 0, 3, extended one trajectory at a time into a
    buffer with grpo_size=2: group a = [1, 0] gets +-0.5/(sqrt(1/2)+eps) = +-0.707106 (Bessel
    std of [1, 0] is sqrt(1/2)); group b = [3, 3] gets 0. Nothing is stored until a group
    completes."""
    pytest.importorskip("torchrl")
    from torchrl.data import LazyStackStorage, ReplayBuffer

    from tether.integrations.torchrl import as_replay_buffer_transform

    rb = ReplayBuffer(storage=LazyStackStorage(16), transform=as_replay_buffer_transform(MCAdvantage(2)), batch_size=4)
    data = one_step_trajectories(["a", "b", "a", "b"], [1.0, 3.0, 0.0, 3.0])
    stored = []
    for i in range(4):
        rb.extend(data[i : i + 1])
        stored.append(len(rb))
    assert stored == [0, 0, 2, 4]
    everything = rb[:]
    by_prompt = {}
    for row in everything.unbind(0):
        by_prompt.setdefault(row["text"], []).append((row["next", "reward"].item(), row["advantage"].item()))
    a = 0.5 / (math.sqrt(0.5) + EPS)
    (r0, a0), (r1, a1) = sorted(by_prompt["a"])
    assert (r0, r1) == (0.0, 1.0)
    assert [a0, a1] == pytest.approx([-a, a], abs=1e-12)
    assert by_prompt["b"] == [(3.0, 0.0), (3.0, 0.0)]
    sample = rb.sample()
    assert "advantage" in sample.keys()


def test_unwrapped_mc_advantage_fails_loudly_on_sample():
    """Given unwrapped, the buffer stores the raw data (its write path for a plain callable is
    the identity) and calls forward on sampling: forward raises, naming the wrapper."""
    pytest.importorskip("torchrl")
    from torchrl.data import LazyStackStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyStackStorage(16), transform=MCAdvantage(2), batch_size=2)
    rb.extend(one_step_trajectories(["a", "a"], [1.0, 0.0]))
    with pytest.raises(KeyError, match="as_replay_buffer_transform"):
        rb.sample()


def test_as_replay_buffer_transform_refuses_other_objects():
    pytest.importorskip("torchrl")
    from tether.integrations.torchrl import as_replay_buffer_transform

    with pytest.raises(TypeError, match="MCAdvantage"):
        as_replay_buffer_transform(torch.nn.Identity())
