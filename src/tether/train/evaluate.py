"""Held-out evaluation: greedy accuracy, reward and the KL to the reference along the answers.

Accuracy and reward use greedy decoding; the reward is the run's (the task's own, or the
reward functions': ``tether.train.rewards``) and accuracy exists only for tasks that define
correctness (a dataset run has none). With no held-out problem both are None. The KL reported is the exact full-vocabulary
KL(pi || pi_ref) at every answer token, averaged per token and summed per answer: greedy
answers are not samples of pi, so a log-ratio estimate along them would not estimate a KL,
while the exact per-position KL is well defined on any sequence.

A task with ``tool_use`` is evaluated on greedy multi-turn episodes
(``tether.train.tasks.make_tool_rollout``); the KL then covers every assistant message, and the tool
statistics of all episodes go to ``EvalResult.tools``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from tether.models import TransformersWrapper
from tether.models.score_plan import row_slices
from tether.models.scoring import exact_kl_tokens
from tether.train.rewards import TaskScorer, samples_from_batch
from tether.train.tasks import Problem, Task, episode_stats, make_tool_rollout, prompt_batch, tool_metrics

_EVAL_BATCH = 64


@dataclass
class EvalResult:
    accuracy: float | None
    kl_per_token: float
    kl_per_seq: float
    response_length: float
    n: int
    tools: dict[str, float] = field(default_factory=dict)
    reward: float | None = None  # mean reward over the held-out answers
    rewards: dict[str, float] = field(default_factory=dict)  # each reward function's mean where it applied

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@torch.no_grad()
def evaluate(
    policy: nn.Module,
    reference: nn.Module | None,
    tokenizer,
    task: Task | Any,
    problems: list[Problem],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    with_kl: bool = True,
    scorer: Any = None,
    prompt_format: str = "chat",
) -> EvalResult:
    """Greedy accuracy and reward on ``problems`` (``scorer``: the task's reward when None) and
    (optionally) the exact KL along the answers."""
    wrapper = TransformersWrapper(
        policy, tokenizer, input_mode="history" if prompt_format == "chat" else "text", generate=True,
        temperature=temperature, generate_kwargs={"max_new_tokens": max_new_tokens, "do_sample": False},
    )
    tool_rollout = make_tool_rollout(task, wrapper)
    rollout = wrapper if tool_rollout is None else tool_rollout
    episodes = []
    scorer = TaskScorer(task) if scorer is None else scorer
    totals, correct, per_function = [], [], []
    kl_sum = torch.zeros((), dtype=torch.float64)
    tokens_total = 0
    for begin, end in row_slices(len(problems), _EVAL_BATCH):
        chunk = problems[begin:end]
        td = rollout(prompt_batch(chunk, prompt_format))
        if tool_rollout is not None:
            episodes.append(episode_stats(td))
        scores = scorer.score(samples_from_batch(td, chunk), where="held-out evaluation")
        totals.append(scores.total)
        correct.append(scores.correct)
        per_function.append(scores.per_function)
        response = td["masks", "all_assistant_mask"]
        tokens_total += int(response.sum())
        if with_kl and reference is not None:
            kl = exact_kl_tokens(policy, reference, td["tokens", "full"], td["masks", "all_attention_mask"],
                                 temperature=temperature, where=response.bool())
            kl_sum += (kl.double() * response.to(kl.device)).sum().cpu()  # the wrapper's masks are on the host
    n = len(problems)
    return EvalResult(
        accuracy=float(torch.cat(correct).mean()) if n and correct[0] is not None else None,
        kl_per_token=float(kl_sum) / max(tokens_total, 1),
        kl_per_seq=float(kl_sum) / max(n, 1),
        response_length=tokens_total / max(n, 1),
        n=n,
        tools=tool_metrics(torch.cat(episodes)) if tool_rollout is not None else {},
        reward=float(torch.cat(totals).mean()) if n else None,
        rewards={k: float(torch.cat([f[k] for f in per_function]).nanmean()) for k in (per_function[0] if n else {})},
    )
