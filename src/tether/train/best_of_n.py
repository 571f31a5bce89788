"""Best-of-n from the untrained policy: the frontier's reference curve that needs no training.

Sample ``m`` answers per problem once, keep the one the task's reward ranks highest among the
first ``n`` (a tie counts as correct when any tied answer is), and place it at the analytic KL
of best-of-n sampling to the policy it draws from, ``log n - (n - 1) / n`` nats (Stiennon et al.
2020; Gao et al. 2022 compare RL against it). The first ``n`` of the ``m`` draws are themselves ``n``
independent draws, so one set of ``m`` serves every ``n <= m``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tether.train.metrics import answered, answering
from tether.train.rewards import TaskReward, samples_from_batch
from tether.train.tasks import Problem


def best_of_n_kl(n: int) -> float:
    """``log n - (n - 1) / n``: the KL (nats) of the best of ``n`` draws to one draw; 0 at ``n = 1``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected an integer >= 1 (draws to pick the best of), got {n!r}.")
    return math.log(n) - (n - 1) / n


def best_of_n_correct(rewards: torch.Tensor, correct: torch.Tensor, n: int) -> torch.Tensor:
    """``bool [P]``: whether the best of the first ``n`` answers of each problem is correct.

    ``rewards`` ``[P, m]`` and ``correct`` ``bool [P, m]``: each problem's ``m`` answers, in draw
    order. The best is the highest reward among columns ``0 .. n-1``; when several answers share
    it the pick counts as correct if any of them is (a selector cannot tell them apart).
    """
    if rewards.shape != correct.shape or rewards.dim() != 2:
        raise ValueError(f"rewards, correct: expected two [P, m] tensors of one shape, got {tuple(rewards.shape)} "
                         f"and {tuple(correct.shape)}.")
    if not 1 <= n <= rewards.shape[1]:
        raise ValueError(f"n: expected 1..{rewards.shape[1]} (the answers drawn per problem), got {n}.")
    first, right = rewards[:, :n], correct[:, :n].bool()
    best = first == first.max(dim=1, keepdim=True).values
    return (best & right).any(dim=1)


@torch.no_grad()
def sample_scored(policy: nn.Module, tokenizer: Any, task: Any, problems: list[Problem], *, samples: int,
                  max_new_tokens: int, temperature: float, seed: int, prompt_format: str = "chat",
                  batch_rows: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rewards float64 [P, samples], correct bool [P, samples])``: ``samples`` answers to each
    problem drawn at ``temperature`` from a generator seeded ``seed``, scored by the task's reward."""
    if samples < 1 or not problems:
        raise ValueError(f"samples, problems: expected at least one of each, got {samples} samples and "
                         f"{len(problems)} problems.")
    wrapper = answering(policy, tokenizer, prompt_format=prompt_format, max_new_tokens=max_new_tokens,
                        temperature=temperature, seed=seed)
    reward = TaskReward(task)
    rows = [p for p in problems for _ in range(samples)]
    totals, correct = [], []
    for chunk, td in answered(wrapper, rows, prompt_format, batch_rows):
        scored = reward(samples_from_batch(td, chunk), where="best-of-n")
        totals.append(scored.total.double())
        correct.append(scored.correct.bool())
    shape = (len(problems), samples)
    return torch.cat(totals).view(shape), torch.cat(correct).view(shape)
