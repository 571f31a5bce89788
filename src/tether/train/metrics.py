"""What a run reports: each step's record, the held-out evaluation and the summary.

``metrics.jsonl`` holds one JSON line per step (``MetricsLog``); the trackers ``report_to`` names
(``tether.integrations.trackers``) get the same values. ``log_completions_every = K`` writes the
first ``COMPLETION_ROWS`` rows of every K-th step's batch to ``RUN/completions.jsonl`` and the
trackers.

The held-out evaluation scores greedy answers with the run's reward (accuracy only for tasks that
define correctness) and measures the exact full-vocabulary KL(pi || pi_ref) at every answer token:
greedy answers are not samples of pi, so a log-ratio along them would not estimate a KL. A tool
task is evaluated on greedy multi-turn episodes. ``summarize`` gives ``summary.json``: held-out
results before and after, the KL budget, the leash's state. The plots are ``tether.train.plots``'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm import tqdm

from tether.models import TransformersWrapper
from tether.models.score_plan import row_slices
from tether.models.scoring import exact_kl_tokens
from tether.train.averaging import FINISH_KEYS
from tether.train.rewards import RewardError, TaskReward, samples_from_batch, with_checkpoints
from tether.train.tasks import Problem, Task, episode_stats, make_tool_rollout, prompt_batch, tool_metrics, tool_summary

if TYPE_CHECKING:  # for the annotations only: tether.train.run imports this module
    from tether.train.run import Run

class MetricsLog:
    """Append-only ``metrics.jsonl`` that can be cut back to a checkpoint's step on resume."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps later than ``step`` (they are recomputed after a resume); the
        lines of steps 1..``step`` must all be there, since they are not recomputed."""
        kept = self.kept_through(step)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def kept_through(self, step: int) -> list[dict[str, Any]]:
        """The lines of steps 1..``step``, each there once, or a ``ValueError`` naming the file."""
        kept = [r for r in self.read() if r["step"] <= step]
        if [r["step"] for r in kept] != list(range(1, step + 1)):
            missing = sorted(set(range(1, step + 1)) - {r["step"] for r in kept})
            raise ValueError(
                f"{self.path}: the lines of steps 1..{step} (the checkpoint's) are not all there once each "
                f"(missing {missing[:10]}, {len(kept)} lines); the file was truncated or edited. Restore it, "
                "or start the run again with --overwrite."
            )
        return kept

    def append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()

    def read(self) -> list[dict[str, Any]]:
        """Every complete line; a last line without its newline is a write cut short by a
        kill (its step has no checkpoint) and is left out."""
        if not self.path.is_file():
            return []
        lines = self.path.read_text().split("\n")[:-1]  # the part after the last newline is unfinished
        records = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{self.path}: line {number} is not valid JSON ({exc}); the file is damaged.") from exc
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError(f"{self.path}: line {number} is not a step record (no integer 'step').")
            records.append(record)
        return records

# ------------------------------------------------------------------------------ logged completions
# The logged completions put a whole group first, so the spread of rewards within a group is visible;
# they go to ``completions.jsonl`` and to the run's trackers (``tether.integrations.trackers``).
COMPLETIONS_FILE = "completions.jsonl"
COMPLETION_ROWS = 8


def due(every: int, done: int) -> bool:
    """Whether a periodic job (evaluation, completion logging) every ``every`` steps runs after ``done``."""
    return bool(every) and done % every == 0


def log_completions(run: Any, done: int, prompts: list[str], answers: list[str], rewards: Any, correct: Any) -> None:
    """Every ``log_completions_every`` steps: the first ``COMPLETION_ROWS`` samples of the step
    (prompts, answers, ``[B]`` rewards and correctness) to ``completions.jsonl`` and the run's tracker."""
    if not due(run.cfg.log_completions_every, done):
        return
    flags = [None] * len(answers) if correct is None else correct.tolist()  # dataset runs define no correctness
    rows = [{"step": done, "prompt": prompt, "completion": answer, "reward": reward, "correct": ok}
            for prompt, answer, reward, ok in zip(prompts, answers, rewards.tolist(), flags)]
    rows = rows[:COMPLETION_ROWS]
    CompletionLog(run.dir).append(rows)
    run.tracker.completions(done, rows)


class CompletionLog:
    """``completions.jsonl``: one JSON line per logged sample, cut back to a step on resume."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / COMPLETIONS_FILE

    def append(self, rows: list[dict[str, Any]]) -> None:
        with self.path.open("a") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in rows))

    def read(self) -> list[dict[str, Any]]:
        from tether.train.jsonl import read_jsonl  # a line that does not parse is named with its number

        return read_jsonl(self.path)

    def truncate_after(self, step: int) -> None:
        if self.path.is_file():
            kept = [r for r in self.read() if r["step"] <= step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))


# ------------------------------------------------------------------------------ held-out evaluation
# The reward is the run's (the task's own, or the reward functions': ``tether.train.rewards``); with no
# held-out problem accuracy and reward are None. On a tool task's episodes the KL covers every
# assistant message, and the tool statistics of all episodes go to ``EvalResult.tools``.
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
    kl_sampled_per_seq: float | None = None  # exact KL per answer sampled at the training temperature
    per_problem: list[float] | None = None  # each problem's correctness (1 right, 0 wrong), greedy, in order

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def answering(policy: nn.Module, tokenizer: Any, *, prompt_format: str, max_new_tokens: int,
              temperature: float = 1.0, seed: int | None = None) -> TransformersWrapper:
    """The generating wrapper the evaluations answer with: greedy when ``seed`` is None, else sampled
    at ``temperature`` from a generator of its own seeded ``seed`` (the run's draws are untouched)."""
    options: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    if seed is None:
        options["do_sample"] = False
    else:
        options["generator"] = torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
    return TransformersWrapper(policy, tokenizer, input_mode="history" if prompt_format == "chat" else "text",
                               generate=True, temperature=temperature, generate_kwargs=options)


def answered(rollout: Any, problems: list[Problem], prompt_format: str, rows: int = _EVAL_BATCH):
    """``(chunk, rollout's answers)`` for ``problems`` in chunks of at most ``rows``."""
    for begin, end in row_slices(len(problems), rows):
        chunk = problems[begin:end]
        yield chunk, rollout(prompt_batch(chunk, prompt_format))


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
    reward: Any = None,
    prompt_format: str = "chat",
    progress: bool = False,
) -> EvalResult:
    """Greedy accuracy and reward on ``problems`` (``reward``: the task's reward when None) and
    (optionally) the exact KL along the answers; ``progress`` shows a bar over the problems."""
    wrapper = answering(policy, tokenizer, prompt_format=prompt_format, max_new_tokens=max_new_tokens,
                        temperature=temperature)
    tool_rollout = make_tool_rollout(task, wrapper)
    rollout = wrapper if tool_rollout is None else tool_rollout
    episodes = []
    reward = TaskReward(task) if reward is None else reward
    totals, correct, per_function = [], [], []
    kl_sum = torch.zeros((), dtype=torch.float64)
    tokens_total = 0
    bar = tqdm(total=len(problems), desc="held-out evaluation", unit="problem", disable=not progress,
               dynamic_ncols=True)
    for chunk, td in answered(rollout, problems, prompt_format):
        if tool_rollout is not None:
            episodes.append(episode_stats(td))
        rewards = reward(samples_from_batch(td, chunk), where="held-out evaluation")
        totals.append(rewards.total)
        correct.append(rewards.correct)
        per_function.append(rewards.per_function)
        response = td["masks", "all_assistant_mask"]
        tokens_total += int(response.sum())
        if with_kl and reference is not None:
            kl = exact_kl_tokens(policy, reference, td["tokens", "full"], td["masks", "all_attention_mask"],
                                 temperature=temperature, where=response.bool())
            kl_sum += (kl.double() * response.to(kl.device)).sum().cpu()  # the wrapper's masks are on the host
        bar.update(len(chunk))
    bar.close()
    n = len(problems)
    return EvalResult(
        accuracy=float(torch.cat(correct).mean()) if n and correct[0] is not None else None,
        per_problem=torch.cat(correct).tolist() if n and correct[0] is not None else None,
        kl_per_token=float(kl_sum) / max(tokens_total, 1),
        kl_per_seq=float(kl_sum) / max(n, 1),
        response_length=tokens_total / max(n, 1),
        n=n,
        tools=tool_metrics(torch.cat(episodes).get("episode", None)) if tool_rollout is not None else {},
        reward=float(torch.cat(totals).mean()) if n else None,
        rewards={k: float(torch.cat([f[k] for f in per_function]).nanmean()) for k in (per_function[0] if n else {})},
    )


@torch.no_grad()
def sampled_kl(policy: nn.Module, reference: nn.Module, tokenizer, task: Task | Any, problems: list[Problem], *,
               max_new_tokens: int, temperature: float, prompt_format: str, seed: int) -> float:
    """Mean exact KL(pi || pi_ref) per answer, summed over its tokens, of one answer per problem
    sampled from ``policy`` at ``temperature``: what the leash holds on the training batches, on
    prompts it never trained on. The generator is its own (``seed``): the run's draws are untouched."""
    wrapper = answering(policy, tokenizer, prompt_format=prompt_format, max_new_tokens=max_new_tokens,
                        temperature=temperature, seed=seed)
    tool_rollout = make_tool_rollout(task, wrapper)
    rollout = wrapper if tool_rollout is None else tool_rollout
    total = torch.zeros((), dtype=torch.float64)
    for _, td in answered(rollout, problems, prompt_format):
        response = td["masks", "all_assistant_mask"].bool()
        kl = exact_kl_tokens(policy, reference, td["tokens", "full"], td["masks", "all_attention_mask"],
                             temperature=temperature, where=response)
        total += (kl.double() * response.to(kl.device)).sum().cpu()
    return float(total) / len(problems)


# ------------------------------------------------------------------------------ summary
def evaluate_run(run: Run, reference: Any, with_kl: bool = True, progress: bool = False) -> dict[str, Any]:
    """Held-out accuracy, reward and (``with_kl``) KL of the policy, as a dict; with a reference also
    the KL of answers sampled at the training temperature (``kl_sampled_per_seq``)."""
    cfg = run.cfg
    try:
        result = evaluate(run.models.policy, reference, run.models.tokenizer, run.task, run.held_out,
                          max_new_tokens=cfg.eval_max_new_tokens, temperature=cfg.temperature, with_kl=with_kl,
                          reward=run.reward, prompt_format=cfg.prompt_format, progress=progress)
    except RewardError as exc:
        raise with_checkpoints(exc, run.dir) from exc
    if reference is not None and run.held_out:
        result.kl_sampled_per_seq = sampled_kl(
            run.models.policy, reference, run.models.tokenizer, run.task, run.held_out,
            max_new_tokens=cfg.eval_max_new_tokens, temperature=cfg.temperature, prompt_format=cfg.prompt_format,
            seed=eval_seed(cfg.seed, cfg.steps))
    return result.as_dict()


def eval_seed(seed: int, step: int) -> int:
    """The seed of the held-out samples after ``step`` steps of a run seeded ``seed``."""
    return seed * 1_000_003 + step + 1


def held_out_metrics(result: dict[str, Any], *, with_kl: bool = True) -> dict[str, float]:
    """A held-out evaluation (``EvalResult.as_dict``) as step metrics, under the names metrics.jsonl
    gives them: ``eval_accuracy``, ``eval_reward``, ``eval_reward/NAME``, ``eval_kl_per_seq``, ...
    (``n`` left out); the KL only ``with_kl`` (it is not measured before training)."""
    out: dict[str, float] = {}
    for key, value in result.items():
        if isinstance(value, dict):  # rewards per function, tool statistics
            prefix = "eval_reward/" if key == "rewards" else "eval_"
            out.update({f"{prefix}{name}": v for name, v in value.items() if isinstance(v, (int, float))})
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "n":
            if with_kl or "kl" not in key:
                out[f"eval_{key}"] = value
    return out


def summarize(run: Run, before: dict, after: dict, seconds: float) -> dict[str, Any]:
    """The run's summary: held-out results before and after, the KL budget, the leash's state."""
    records = run.metrics.read()
    tail = records[-3:]
    final_kl = _tail_mean(tail, "kl_per_seq") or 0.0
    summary = {
        "model": run.cfg.model,
        "task": run.task.name,
        "steps": run.cfg.steps,
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "accuracy_gain_points": None if after["accuracy"] is None else 100 * (after["accuracy"] - before["accuracy"]),
        "reward_before": before.get("reward"),
        "reward_after": after.get("reward"),
        **{f"reward/{name}_{when}": value for when, result in (("before", before), ("after", after))
           for name, value in result.get("rewards", {}).items()},
        "eval_kl_per_token": after["kl_per_token"],
        "eval_kl_per_seq": after["kl_per_seq"],
        "eval_kl_sampled_per_seq": after.get("kl_sampled_per_seq"),
        "per_problem_before": before.get("per_problem"),
        "per_problem_after": after.get("per_problem"),
        "final_train_kl_per_seq": final_kl,
        "final_train_kl_exact_per_seq": _tail_mean(tail, "kl_exact_per_seq"),
        "kl_bound": run.cfg.kl_bound,
        "kl_within_bound": not run.cfg.kl_bound or all(not r.get("kl_over_bound") for r in records),
        "steps_over_kl_bound": sum(bool(r.get("kl_over_bound")) for r in records),
        "steps_rejected": sum(bool(r.get("step_rejected")) for r in records),
        "final_kl_coef": float(run.leash.kl_coef),
        "seconds_this_process": seconds,
        "seconds_in_steps": sum(r.get("step_time", 0.0) for r in records),
        "eval_size": len(run.held_out),
        **({"best_eval_step": run.best.step, "best_eval_accuracy": run.best.accuracy} if run.cfg.eval_every else {}),
        **tool_summary(before, after),
        **{key: records[-1][key] for key in FINISH_KEYS if records and key in records[-1]},  # the finishes'
    }
    numbers = [key for key, value in summary.items() if isinstance(value, (int, float)) and not isinstance(value, bool)]
    return {**summary, "units": {key: summary_unit(key) for key in numbers}}


# The unit of each number in summary.json, in its "units" entry: the first pattern a key matches.
_SUMMARY_UNITS: tuple[tuple[str, str], ...] = (
    ("accuracy_gain_points", "percentage points of held-out accuracy"),
    ("accuracy", "fraction of the held-out problems answered right (greedy)"),
    ("reward/", "mean of this reward function over the held-out problems"),
    ("reward_", "mean reward over the held-out problems"),
    ("kl_per_token", "nats per answer token (exact over the vocabulary)"),
    ("kl_sampled_per_seq", "nats per held-out answer sampled at the training temperature, summed over its tokens "
                           "(exact over the vocabulary)"),
    ("kl_exact_per_seq", "nats per answer, summed over its tokens (exact over the vocabulary)"),
    ("kl_per_seq", "nats per answer, summed over its tokens"),
    ("final_interpolation", "lambda of the final weights theta_0 + lambda (theta_T - theta_0)"),
    ("weight_average_scale", "scale kept on the line from the reference to the averaged weights"),
    ("steps_over_kl_bound", "training steps whose kept weights read over kl_bound"),
    ("steps_rejected", "training steps whose update was rejected"),
    ("kl_bound", "nats per answer"),
    ("kl_coef", "beta, the KL penalty's weight"),
    ("seconds_this_process", "seconds of wall clock in the process that wrote this file (a resumed run's "
                             "earlier processes not counted)"),
    ("seconds_in_steps", "seconds of wall clock in training steps, summed over every process of the run"),
    ("eval_size", "held-out problems"),
    ("step", "training steps"),
    ("rate", "fraction of held-out episodes"),
    ("per_episode", "per held-out episode"),
)


def summary_unit(key: str) -> str | None:
    """The unit of a numeric ``summary.json`` entry (None for a key no pattern covers)."""
    return next((unit for pattern, unit in _SUMMARY_UNITS if pattern in key), None)


def _tail_mean(tail: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in tail if key in r]
    return sum(values) / len(values) if values else None
