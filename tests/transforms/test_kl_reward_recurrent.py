"""KLRewardTransform with a recurrent actor whose hidden state is absent at the first step.

The actor's own module decides which inputs it can run without (as TorchRL's LSTMModule
does: a missing hidden state means zeros); the transform follows it instead of demanding
every input, and still names an input the actor cannot do without.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import InteractionType, TensorDictModuleBase
from tensordict.nn import ProbabilisticTensorDictModule as ProbModule
from tensordict.nn import ProbabilisticTensorDictSequential as ProbSequential
from torch import distributions as D
from torch import nn

from tether.transforms import KLRewardTransform

F64 = torch.float64


class TinyRecurrentCore(TensorDictModuleBase):
    """loc = w * obs + u * h with h = 0 when ("rs_h") is absent; scale = 1."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.5, dtype=F64))
        self.u = nn.Parameter(torch.tensor(2.0, dtype=F64))
        self.in_keys = ["observation", "rs_h"]
        self.out_keys = ["loc", "scale"]

    def forward(self, td):
        obs = td.get("observation")
        hidden = td.get("rs_h", None)
        hidden = torch.zeros_like(obs) if hidden is None else hidden
        td.set("loc", self.w * obs + self.u * hidden)
        td.set("scale", torch.ones_like(obs))
        return td


def recurrent_actor():
    head = ProbModule(in_keys=["loc", "scale"], out_keys=["action"], distribution_class=D.Normal,
                      return_log_prob=True, default_interaction_type=InteractionType.RANDOM)
    return ProbSequential(TinyRecurrentCore(), head)


def test_first_step_without_hidden_state():
    """Snapshot at w = 0.5, u = 2, then w -> 1.5. First step (no hidden state): obs = 1,
    action = 2, reward 0, coef 0.5. log pi(a) - log pi_0(a) = [-(2 - 1.5)^2 + (2 - 0.5)^2] / 2
    = (2.25 - 0.25) / 2 = 1, so the reward becomes -0.5. With a hidden state h = 0.25 the
    locs are 2.0 and 1.0: log-ratio [-(0)^2 + (1)^2] / 2 = 0.5, reward -0.25."""
    actor = recurrent_actor()
    transform = KLRewardTransform(actor, coef=0.5)
    with torch.no_grad():
        actor.module[0].w.fill_(1.5)

    def step(hidden=None):
        td = TensorDict({"observation": torch.tensor([1.0], dtype=F64), "action": torch.tensor([2.0], dtype=F64),
                         ("next", "reward"): torch.zeros(1, dtype=F64)}, batch_size=[1])
        if hidden is not None:
            td["rs_h"] = torch.tensor([hidden], dtype=F64)
        td[actor.log_prob_key] = actor.get_dist(td.clone()).log_prob(td["action"]).detach()
        return transform(td)["next", "reward"]

    torch.testing.assert_close(step(), torch.tensor([-0.5], dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(step(0.25), torch.tensor([-0.25], dtype=F64), rtol=0, atol=1e-12)


def test_an_input_the_actor_needs_is_still_named():
    actor = recurrent_actor()
    transform = KLRewardTransform(actor)
    td = TensorDict({"action": torch.tensor([2.0], dtype=F64), ("next", "reward"): torch.zeros(1, dtype=F64),
                     actor.log_prob_key: torch.zeros(1, dtype=F64)}, batch_size=[1])
    with pytest.raises(KeyError, match=r"could not run without its input\(s\) 'observation', 'rs_h'.*Present keys"):
        transform(td)
