"""TorchRL's ``MCAdvantage`` replay-buffer test (``test/llm/test_llm_objectives.py::
TestMCAdvantage::test_mc_advantage``) on tether's API.

TorchRL's buffer wraps any callable that is not a TorchRL ``Transform`` so that its write
path is the identity and only its forward runs, on sampled data. ``MCAdvantage`` groups on
the write path, and tether does not subclass TorchRL's ``Transform`` (TorchRL stays out of
tether's environment), so the unwrapped module cannot be a drop-in: its forward refuses the raw
steps, naming the wrapper and the one-line change. The wrapper's write path is ``add``.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from tether.objectives import MCAdvantage

PROMPTS = ["Lorem ipsum dolor sit amet,", "consectetur adipiscing elit,"]
FIX = r"as_replay_buffer_transform.*rb\.append_transform\(as_replay_buffer_transform\(MCAdvantage\(\.\.\.\)\)\)"


def trajectory(prompt, tokens_per_step, seed):
    """A lazy stack of steps: the prompt under ``"query"`` (TorchRL 0.14's key), a per-token
    reward ``[n, 1]`` of its own length each step, done on the last step only."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for i, n in enumerate(tokens_per_step):
        step = TensorDict({"next": TensorDict({"reward": torch.randn(n, 1, generator=gen, dtype=torch.float64),
                                               "done": torch.tensor([i == len(tokens_per_step) - 1])}, [])}, [])
        step["query"] = prompt
        steps.append(step)
    return lazy_stack(steps)


def expected_advantages(group):
    """Every reward entry of the group's steps z-scored together (Bessel spread + 1e-6)."""
    flat = torch.cat([r.reshape(-1) for traj in group for r in traj.get(("next", "reward"), as_list=True)])
    return (flat - flat.mean()) / (flat.std() + 1e-6)


def batches(ndim):
    """TorchRL's two layouts: one trajectory per extend, or three 2-step trajectories flattened."""
    lengths = [[3, 1], [2, 4], [1, 1], [5, 2]]
    trajs = [trajectory(PROMPTS[0], lengths[k], seed=k) for k in range(4)]
    if ndim == 1:
        return trajs, [trajs]
    others = [trajectory(PROMPTS[1], [2, 2], seed=10 + k) for k in range(2)]
    flat = [lazy_stack([trajs[0], others[0], trajs[1]]).view(-1), lazy_stack([trajs[2], others[1], trajs[3]]).view(-1)]
    return flat, [trajs, others]


@pytest.mark.parametrize("ndim", [1, 2])
def test_mc_advantage_in_a_buffer(ndim):
    """Given unwrapped, the module sees only sampled raw steps (the buffer's forward path) and
    raises a KeyError naming the wrapper and the append_transform change; through the
    wrapper's write path (``add``), each completed group of 4 comes out with every reward entry
    z-scored over the group (``ndim=2``: trajectories of two prompts interleaved and flattened,
    one group completes)."""
    written, groups = batches(ndim)
    unwrapped = MCAdvantage(grpo_size=4, prompt_key="query")
    with pytest.raises(KeyError, match=FIX):
        unwrapped(written[0][0])
    wrapped = MCAdvantage(grpo_size=4, prompt_key="query")
    emitted = [out for batch in written if (out := wrapped.add(batch)) is not None]
    assert len(emitted) == 1
    out = emitted[0]
    got = torch.cat([a.reshape(-1) for a in out.get("advantage", as_list=True)])
    torch.testing.assert_close(got, expected_advantages(groups[0]), rtol=0, atol=1e-12)
    assert wrapped.pending() == ({} if ndim == 1 else {"text:" + PROMPTS[1]: 2})


@pytest.mark.parametrize("ndim", [1, 2])
def test_mc_advantage_in_a_torchrl_buffer(ndim):
    """The same through TorchRL's ``ReplayBuffer.append_transform`` (skips without TorchRL):
    unwrapped, sampling raises the KeyError above; wrapped, the sample holds advantages."""
    pytest.importorskip("torchrl")
    from torchrl.data import LazyStackStorage, ReplayBuffer

    from tether.integrations.torchrl import as_replay_buffer_transform

    written, _ = batches(ndim)
    rb = ReplayBuffer(storage=LazyStackStorage(100))
    rb.append_transform(MCAdvantage(grpo_size=4, prompt_key="query"))
    for batch in written:
        rb.extend(batch)
    with pytest.raises(KeyError, match=FIX):
        rb.sample(1)
    rb = ReplayBuffer(storage=LazyStackStorage(100))
    rb.append_transform(as_replay_buffer_transform(MCAdvantage(grpo_size=4, prompt_key="query")))
    for batch in written:
        rb.extend(batch)
    assert len(rb) == 8 and "advantage" in rb.sample(1).keys()
