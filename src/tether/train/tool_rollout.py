"""Multi-turn rollouts with tools in the recipe, for tasks that declare ``tool_use``.

The recipe calls three things from here and is otherwise unchanged: ``tool_rollout`` replaces
the single-turn sampling of a step (the batch carries the same keys, with the assistant mask
covering every assistant message and the log-probs recorded at sampling), ``tool_metrics``
adds the step's tool statistics to its metrics line, and ``check_tool_task`` refuses set-ups
that cannot run them yet. Evaluation (``tether.train.evaluate``) runs the same rollout with
greedy decoding through ``make_tool_rollout``.
"""

from __future__ import annotations

from typing import Any

import torch

from tether.llm import chat_batch
from tether.models import TransformersWrapper
from tether.rollout import MultiTurnRollout, episode_metrics
from tether.train.tasks import Problem, Task

__all__ = ["check_tool_task", "episode_stats", "make_tool_rollout", "tool_metrics", "tool_rollout", "tool_summary"]


def make_tool_rollout(task: Task, sampler: TransformersWrapper) -> MultiTurnRollout | None:
    """The task's multi-turn rollout over ``sampler``, or None for a single-turn task."""
    use = task.tool_use
    if use is None:
        return None
    return MultiTurnRollout(sampler, list(use.tools), max_turns=use.max_turns, max_tokens=use.max_tokens)


def check_tool_task(task: Task, workers: int) -> None:
    """Refuse Ray rollout workers for a tool task: they sample single-turn answers only."""
    if task.tool_use is not None and workers > 0:
        raise ValueError(
            f"workers={workers}: task {task.name!r} needs multi-turn rollouts with tools, which run "
            "in-process only; use workers=0."
        )


def tool_rollout(run: Any, problems: list[Problem]):
    """Sample one episode per problem (already repeated ``group_size`` times) with the run's sampler."""
    rollout = make_tool_rollout(run.task, run.sampler)
    batch = chat_batch([p.chat for p in problems], key=("history", "prompt"))
    with torch.no_grad():
        rollout(batch)
    return batch


def tool_metrics(batch) -> dict[str, float]:
    """``tool_call_rate``, ``tool_calls_per_episode``, ``tool_error_rate``, ``turns_per_episode``
    of a multi-turn batch; nothing for a single-turn one."""
    if ("episode", "turns") not in batch.keys(include_nested=True):
        return {}
    return episode_metrics(batch["episode"])


def episode_stats(batch):
    """The ``("episode", ...)`` counters of a multi-turn batch (``torch.cat`` them across chunks)."""
    return batch.select(*[("episode", key) for key in ("turns", "tool_calls", "tool_errors")])


def tool_summary(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Held-out tool statistics before and after training, for the run summary."""
    out = {}
    for name, result in (("before", before), ("after", after)):
        for key, value in (result.get("tools") or {}).items():
            out[f"eval_{key}_{name}"] = value
    return out
