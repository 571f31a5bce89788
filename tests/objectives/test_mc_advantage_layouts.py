"""MCAdvantage on TorchRL's layouts (lazy stacks of steps) and its checks at ``add`` time.

Trajectories are lazy stacks of steps, each step a 0-dim TensorDict with a per-token reward
``[1, n, 1]``, the layout of TorchRL's own MCAdvantage tests and of its collectors.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from tether.models.batch_io import write_objects
from tether.objectives import MCAdvantage

F64 = torch.float64
EPS = 1e-6  # added to the group spread by grpo


def step(prompt, rewards, done):
    td = TensorDict(
        {
            ("next", "reward"): torch.tensor(rewards, dtype=F64).reshape(1, -1, 1),
            ("next", "done"): torch.tensor([done]),
        },
        batch_size=[],
    )
    td["text"] = prompt
    return td


def trajectory(prompt, per_step_rewards):
    """A lazy stack of steps; only the last one is done."""
    last = len(per_step_rewards) - 1
    return lazy_stack([step(prompt, r, i == last) for i, r in enumerate(per_step_rewards)])


def step_advantages(out):
    """Advantages of every step of an emitted group, flattened in order."""
    return [a for s in out.unbind(0) for a in s["advantage"].flatten().tolist()]


def test_token_rewards_shaped_1_n_1_per_step():
    """Steps with rewards [1, n, 1] stack to a jagged [L, 1, j, 1] (ragged at dim 2). Group of
    two: entries 1 | 0, 1 and 0, 0, 1 | 0: four 0s, three 1s, mean 3/7, Bessel variance
    (3 (4/7)^2 + 4 (3/7)^2) / 6 = 2/7. A 1 gets (4/7) / sqrt(2/7) = 4/sqrt(14) = 1.069045,
    a 0 gets -3/sqrt(14) = -0.801784 (each divided by spread + eps)."""
    spread = math.sqrt(2 / 7)
    hi, lo = (4 / 7) / (spread + EPS), (-3 / 7) / (spread + EPS)
    mc = MCAdvantage(2)
    assert mc.add(trajectory("a", [[1.0], [0.0, 1.0]])) is None
    out = mc.add(trajectory("a", [[0.0, 0.0, 1.0], [0.0]]))
    got = step_advantages(out)
    torch.testing.assert_close(torch.tensor(got, dtype=F64), torch.tensor([hi, lo, hi, lo, lo, hi, lo], dtype=F64),
                               rtol=0, atol=1e-12)
    assert [tuple(s["advantage"].shape) for s in out.unbind(0)] == [(1, 1, 1), (1, 2, 1), (1, 3, 1), (1, 1, 1)]


def test_steps_with_equal_token_counts_are_accepted():
    """A lazy stack whose steps happen to have equal token counts reads as a dense [L, 1, n, 1]
    without padding: it is accepted like a ragged one. Group: [1, 0], [1, 1] (equal lengths)
    and [0], [0, 0, 1]: four 1s and four 0s, mean 1/2, Bessel variance 8 (1/4) / 7 = 2/7,
    advantages +-0.5 / sqrt(2/7) = +-0.935414."""
    value = 0.5 / (math.sqrt(2 / 7) + EPS)
    mc = MCAdvantage(2)
    assert mc.add(trajectory("a", [[1.0, 0.0], [1.0, 1.0]])) is None
    out = mc.add(trajectory("a", [[0.0], [0.0, 0.0, 1.0]]))
    expected = [value, -value, value, value, -value, -value, -value, value]
    torch.testing.assert_close(torch.tensor(step_advantages(out), dtype=F64), torch.tensor(expected, dtype=F64),
                               rtol=0, atol=1e-12)


def test_a_trajectory_without_reward_is_refused_alone():
    """Issue #14 item 6: the bad trajectory raises at add; the valid one already queued stays
    queued and completes its group with the next valid trajectory."""
    mc = MCAdvantage(2)
    assert mc.add(trajectory("a", [[1.0]])) is None
    bad = trajectory("a", [[0.0]])
    del bad["next", "reward"]
    with pytest.raises(KeyError, match=r"reward.*missing"):
        mc.add(bad)
    assert mc.pending() == {"text:a": 1}
    out = mc.add(trajectory("a", [[0.0]]))
    assert step_advantages(out) == pytest.approx([0.5 / (math.sqrt(0.5) + EPS), -0.5 / (math.sqrt(0.5) + EPS)])


def test_a_batch_holding_a_bad_trajectory_queues_nothing():
    """Two one-step trajectories in one add, the second with a prompt that is not a string or
    chat: the whole add is refused before anything is queued (the seed queued the first and
    then failed), so re-adding the fixed batch counts each trajectory once."""
    mc = MCAdvantage(3)
    batch = TensorDict({("next", "reward"): torch.ones(2, 1, dtype=F64), ("next", "done"): torch.ones(2, 1, dtype=torch.bool)},
                       batch_size=[2])
    write_objects(batch, "text", ["b", 42])
    with pytest.raises(TypeError, match=r"prompt: expected a string or a chat"):
        mc.add(batch)
    assert mc.pending() == {}
    write_objects(batch, "text", ["b", "c"])
    mc.add(batch)
    assert mc.pending() == {"text:b": 1, "text:c": 1}


def test_forward_refuses_data_that_never_went_through_add():
    """A TorchRL ReplayBuffer given MCAdvantage unwrapped never calls add (its write path for
    plain callables is the identity) and calls forward on sampled data: that must fail loudly."""
    mc = MCAdvantage(2)
    raw = trajectory("a", [[1.0]])
    with pytest.raises(KeyError, match=r"advantage.*as_replay_buffer_transform"):
        mc(raw)
    mc.add(trajectory("a", [[0.0]]))
    out = mc.add(raw)
    assert mc(out) is out
