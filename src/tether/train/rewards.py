"""Rewards of a step's samples: the task's own reward, or reward functions and a reward model.

``--reward-funcs FILE.py`` follows TRL's ``GRPOTrainer`` convention: each function is called
once per batch by keyword, ``f(prompts=..., completions=..., completion_ids=..., **columns)``,
and returns one ``float`` or ``None`` per sample; the file's ``REWARD_FUNCS``, or else its
public functions in order. ``--reward-model DIR`` adds a local sequence-classification model
as one more function. A sample's reward is ``sum_i w_i r_i`` over the functions that apply to
it; a sample no function applies to is an error (TRL warns and gives 0), and each function's
mean is logged under ``reward/<name>``. A function that raises or returns a bad value raises
``RewardError`` naming the function, its file and the sample; ``async def`` functions of a
step run concurrently in one event loop. The full convention: ``docs/rewards.md``.
``dynamic_sampling`` (DAPO's) draws the step's share of prompts again until its groups' rewards
differ (``keep_informative``); unlike DAPO, which trains on fewer groups, a step that runs out of
``max_resample`` draws fills up with equal-reward groups, so every step and rank keeps its shape.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import reprlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from tether.models.records import StepRecord, group_ids
from tether.models.score_plan import row_slices
from tether.train.run_files import describe_checkpoints
from tether.train.tasks import Problem, Task, load_user_module

_RESERVED = ("prompts", "completions", "completion_ids")
_RM_BATCH = 16


class RewardError(ValueError):
    """A reward function or task reward raised or returned an unusable value for a sample."""


def with_checkpoints(exc: RewardError, run_dir: Path) -> RewardError:
    """``exc`` followed by what ``run_dir`` holds to resume from."""
    return RewardError(f"{exc} {describe_checkpoints(run_dir)}")


@dataclass
class Samples:
    """One batch to score: each sample's problem, completion text and completion token ids."""

    problems: list[Problem]
    completions: list[str]
    completion_ids: list[list[int]]


@dataclass
class Rewards:
    """Attributes: ``total`` float32 ``[B]`` (the reward the advantages use); ``correct`` float32 ``[B]``
    or None when the task defines no correctness; ``per_function`` float32 ``[B]`` per function, NaN
    where it returned None."""

    total: torch.Tensor
    correct: torch.Tensor | None
    per_function: dict[str, torch.Tensor]

    @classmethod
    def cat(cls, parts: list["Rewards"]) -> "Rewards":
        correct = None if parts[0].correct is None else torch.cat([p.correct for p in parts])
        return cls(torch.cat([p.total for p in parts]), correct,
                   {k: torch.cat([p.per_function[k] for p in parts]) for k in parts[0].per_function})

    def take(self, index: torch.Tensor) -> "Rewards":
        return Rewards(self.total[index], None if self.correct is None else self.correct[index],
                      {k: v[index] for k, v in self.per_function.items()})


@dataclass(frozen=True)
class RewardFunction:
    name: str
    fn: Callable[..., Any]
    origin: str  # where it was defined, for error messages


def _sample_text(samples: Samples, i: int) -> str:
    return f"sample {i} (prompt {samples.problems[i].chat[-1]['content']!r}, completion {samples.completions[i]!r})"


def _correct(task: Any, samples: Samples) -> torch.Tensor | None:
    if not isinstance(task, Task):
        return None
    return torch.tensor([float(task.correct_value(task.is_correct(c, p)))
                         for c, p in zip(samples.completions, samples.problems)])


class TaskReward:
    """The task's own per-sample ``reward`` and ``is_correct``."""

    def __init__(self, task: Task) -> None:
        self.task = task

    def __call__(self, samples: Samples, where: str) -> Rewards:
        task, rewards = self.task, []
        for i, (answer, problem) in enumerate(zip(samples.completions, samples.problems)):
            try:
                raw = task.reward(answer, problem)
            except Exception as exc:  # the user's reward code: report which sample broke it
                raise RewardError(f"task {task.name!r}: reward raised {type(exc).__name__}: {exc} at {where}, "
                                  f"{_sample_text(samples, i)}. Fix the reward function.") from exc
            value = task.reward_value(raw)
            if not math.isfinite(value):
                raise RewardError(f"task {task.name!r}: reward returned {value} at {where}, "
                                  f"{_sample_text(samples, i)}; rewards must be finite.")
            rewards.append(value)
        return Rewards(torch.tensor(rewards, dtype=torch.float32), _correct(task, samples), {})


class FunctionReward:
    """Weighted reward functions in TRL's convention (see the module docstring)."""

    def __init__(self, functions: list[RewardFunction], weights: list[float], prompt_format: str,
                 task: Any = None) -> None:
        self.functions, self.weights, self.prompt_format, self.task = functions, weights, prompt_format, task

    def _inputs(self, samples: Samples) -> dict[str, list]:
        chat = self.prompt_format == "chat"
        names = [k for p in samples.problems for k in p.columns]
        _check_no_clash(names)
        columns = {k: [p.columns.get(k) for p in samples.problems] for k in dict.fromkeys(names)}
        return {"prompts": [p.chat if chat else p.text for p in samples.problems],
                "completions": [[{"role": "assistant", "content": c}] if chat else c for c in samples.completions],
                "completion_ids": samples.completion_ids, **columns}

    def __call__(self, samples: Samples, where: str) -> Rewards:
        inputs, n = self._inputs(samples), len(samples.completions)
        outputs = [_call(func, inputs, n, samples, where) for func in self.functions]  # values or coroutines
        pending = [i for i, out in enumerate(outputs) if inspect.isawaitable(out)]
        for i, result in zip(pending, _await_all([outputs[i] for i in pending])):
            if isinstance(result, Exception):
                _raise_named(self.functions[i], result, inputs, n, samples, where)
            outputs[i] = result
        per_function = {}
        for func, out in zip(self.functions, outputs):
            values = _checked_values(func, out, n, samples, where)
            per_function[func.name] = torch.tensor(values, dtype=torch.float64)
        table = torch.stack([per_function[f.name] for f in self.functions], dim=1)  # [B, F], NaN = None
        none = table.isnan().all(dim=1).nonzero().flatten().tolist()
        if none:
            raise RewardError(f"every reward function ({', '.join(f.name for f in self.functions)}) returned None "
                              f"for {_sample_text(samples, none[0])} at {where}; at least one must apply to "
                              "each sample. Make one of them return a number for it.")
        total = (table * torch.tensor(self.weights, dtype=torch.float64)).nansum(dim=1)
        return Rewards(total.float(), _correct(self.task, samples), {k: v.float() for k, v in per_function.items()})


def _check_no_clash(columns: list[str]) -> None:
    clash = sorted(set(columns) & set(_RESERVED))
    if clash:
        raise RewardError(f"dataset columns {clash} have the names of the reward functions' own arguments "
                          f"{list(_RESERVED)}; rename those columns.")


def _check_arguments(func: RewardFunction, names: list[str], holder: str) -> None:
    """Refuse ``func`` if a call with the keyword arguments ``names`` would fail to bind: a
    required parameter ``holder`` (the batch, a dataset) lacks, or extra names and no ``**kwargs``."""
    try:
        signature = inspect.signature(func.fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call itself will tell
        return
    missing = [name for name, p in signature.parameters.items() if p.default is p.empty and name not in names
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise RewardError(f"reward function {func.name} ({func.origin}) needs {missing}, which {holder} does not "
                          f"have (its arguments: {sorted(names)}); add those columns to the dataset or give the "
                          "parameters defaults.")
    try:
        signature.bind(**dict.fromkeys(names))
    except TypeError as exc:
        raise RewardError(f"reward function {func.name} ({func.origin}) cannot take the arguments "
                          f"{sorted(names)} by keyword ({exc}); give it a **kwargs parameter.") from exc


def check_dataset_arguments(functions: list[RewardFunction], task: Any) -> None:
    """Refuse, before any model loads, reward functions that a dataset's columns cannot call.

    Only a dataset's rows are all known up front; a task's problems are drawn step by step, so
    its functions are checked at their first call."""
    if not functions or isinstance(task, Task) or not hasattr(task, "held_out"):
        return
    columns = list(dict.fromkeys(k for p in (*task.train, *task.held_out) for k in p.columns))
    _check_no_clash(columns)
    for func in functions:
        _check_arguments(func, [*_RESERVED, *columns], f"dataset {task.name}")


def _call(func: RewardFunction, inputs: dict[str, list], n: int, samples: Samples, where: str) -> Any:
    """``func`` on the batch: its values, or its coroutine when it is ``async``."""
    _check_arguments(func, list(inputs), "the batch")
    try:
        return func.fn(**inputs)
    except Exception as exc:  # user code: find the sample that breaks it
        _raise_named(func, exc, inputs, n, samples, where)


def _raise_named(func: RewardFunction, exc: Exception, inputs: dict[str, list], n: int, samples: Samples,
                 where: str) -> NoReturn:
    culprit = _first_failing(func, inputs, n)
    which = _sample_text(samples, culprit) if culprit is not None else f"the batch of {n} samples (no sample alone fails)"
    raise RewardError(f"reward function {func.name} ({func.origin}) raised {type(exc).__name__}: {exc} at "
                      f"{where} on {which}. Fix the function.") from exc


def _first_failing(func: RewardFunction, inputs: dict[str, list], n: int) -> int | None:
    for i in range(n):
        try:
            out = func.fn(**{k: v[i : i + 1] for k, v in inputs.items()})
            if inspect.isawaitable(out) and isinstance(_await_all([out])[0], Exception):
                return i
        except Exception:
            return i
    return None


def _await_all(awaitables: list) -> list:
    """Results of ``awaitables`` run concurrently in one event loop (an exception in place of the
    result of one that raised). Inside a running loop (a notebook), the loop runs on a thread."""
    if not awaitables:
        return []

    async def gather() -> list:
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def _checked_values(func: RewardFunction, out: Any, n: int, samples: Samples, where: str) -> list[float]:
    head = f"reward function {func.name} ({func.origin}) at {where}"
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
        raise RewardError(f"{head} returned {type(out).__name__} {reprlib.repr(out)}, expected a list of "
                          f"{n} floats or None (one per sample).")
    if len(out) != n:
        raise RewardError(f"{head} returned {len(out)} values for {n} samples; return one float or None per sample.")
    values = []
    for i, value in enumerate(out):
        if value is None:
            values.append(math.nan)
            continue
        if not hasattr(type(value), "__float__") or isinstance(value, (str, bytes)):
            raise RewardError(f"{head} returned {type(value).__name__} {reprlib.repr(value)} for "
                              f"{_sample_text(samples, i)}, expected a float or None.")
        number = float(value)
        if not math.isfinite(number):
            raise RewardError(f"{head} returned {number} for {_sample_text(samples, i)}; rewards must be finite "
                              "(return None where the function does not apply).")
        values.append(number)
    return values


def load_reward_funcs(path: str) -> list[RewardFunction]:
    """The file's ``REWARD_FUNCS``, or every public function defined in it, in order."""
    file = Path(path)
    module = load_user_module(file, "reward_funcs")
    chosen = getattr(module, "REWARD_FUNCS", None)
    if chosen is None:
        chosen = [v for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_")
                  and v.__module__ == module.__name__]
    if not isinstance(chosen, (list, tuple)) or not chosen or not all(callable(f) for f in chosen):
        raise ValueError(f"reward_funcs: {path} defines no reward function (expected public functions "
                         f"f(prompts, completions, **kwargs) or a REWARD_FUNCS list of them, got {chosen!r}).")
    return [RewardFunction(getattr(f, "__name__", type(f).__name__), f, str(file)) for f in chosen]


def parse_weights(text: str, names: list[str]) -> list[float]:
    """``--reward-weights`` as floats, one per function (all 1 when empty)."""
    if not text.strip():
        return [1.0] * len(names)
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise ValueError(f"reward_weights: expected comma-separated numbers, got {text!r}.") from None
    if len(weights) != len(names) or not all(math.isfinite(w) for w in weights):
        raise ValueError(f"reward_weights: expected {len(names)} finite numbers, one for each of {names} in "
                         f"that order, got {text!r}.")
    return weights


class RewardModelFunction:
    """A local sequence-classification model as a reward function: its end score per sample."""

    def __init__(self, path: str, prompt_format: str, device: torch.device) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from tether.models import SequenceRewardModel
        from tether.models.loading import check_not_pickled

        check_not_pickled(Path(path), "reward_model")
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, local_files_only=True, dtype=torch.float32, use_safetensors=True).to(device).eval()
        if prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"reward_model: {path}'s tokenizer has no chat template to render chat prompts; "
                             "use a reward model with one, or --prompt-format text.")
        self.model, self.chat, self.__name__ = SequenceRewardModel(model, tokenizer), prompt_format == "chat", Path(path).name

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **_: Any) -> list[float]:
        tok = self.model.tokenizer
        texts = [tok.apply_chat_template(p + c, tokenize=False) if self.chat else p + c
                 for p, c in zip(prompts, completions)]
        scores = [self.model.score_texts(texts[b:e]).end_scores for b, e in row_slices(len(texts), _RM_BATCH)]
        return torch.cat(scores).tolist()


def reward_functions(cfg: Any, task: Any, given: list[RewardFunction] | None = None) -> list[RewardFunction]:
    """The functions of ``cfg.reward_funcs`` (its file runs once, here) or ``given`` (Python callables),
    checked against a dataset's columns; needs no model, so a run can fail before loading one."""
    functions = given if given is not None else load_reward_funcs(cfg.reward_funcs) if cfg.reward_funcs else []
    check_dataset_arguments(functions, task)
    return functions


def build_reward(cfg: Any, task: Any, device: torch.device,
                 functions: list[RewardFunction] | None = None) -> TaskReward | FunctionReward:
    """The task's own reward, or ``cfg.reward_funcs`` (``functions`` when already loaded by
    ``reward_functions``) and ``cfg.reward_model`` with their weights."""
    if not (cfg.reward_funcs or cfg.reward_model):
        return TaskReward(task)
    functions = list(reward_functions(cfg, task) if functions is None else functions)
    if cfg.reward_model:
        functions.append(RewardFunction(Path(cfg.reward_model).name,
                                        RewardModelFunction(cfg.reward_model, cfg.prompt_format, device),
                                        cfg.reward_model))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ValueError(f"reward_funcs: the reward names {names} repeat; each is logged under its own name, "
                         "so rename the function (or the reward model's directory).")
    return FunctionReward(functions, parse_weights(cfg.reward_weights, names), cfg.prompt_format, task)


def samples_from_batch(batch: Any, problems: list[Problem]) -> Samples:
    """The completions of a sampled batch (``("text", "response")`` and the assistant tokens)."""
    tokens, mask = batch["tokens", "full"], batch["masks", "all_assistant_mask"]
    return Samples(problems, batch.get(("text", "response")).tolist(),
                   [row[m].tolist() for row, m in zip(tokens, mask.bool())])


# ------------------------------------------------------------------ dynamic sampling
Draw = Callable[[list[Problem]], tuple[StepRecord, Rewards]]


def informative(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``bool [G]``: the groups (``group_size`` consecutive answers) whose rewards are not all equal;
    a group of equal rewards has advantage 0 and gives the policy no gradient."""
    grouped = rewards.view(-1, group_size)
    return (grouped != grouped[:, :1]).any(-1)


def resampled_problems(run: Any, step: int, draw: int) -> list[Problem]:
    """This rank's share of the step's ``draw``-th extra prompts, each ``group_size`` times. They are
    read from the problem stream at negative indices, which no step's own prompts use."""
    cfg = run.cfg
    first = -1 - ((step * cfg.max_resample + draw - 1) * cfg.prompts_per_step)
    problems = [run.task.train_problem(cfg.seed, first - i, run.excluded) for i in run.ranks.share(cfg.prompts_per_step)]
    return [p for p in problems for _ in range(cfg.group_size)]


def keep_informative(run: Any, step: int, draw: Draw, problems: list[Problem]
                     ) -> tuple[list[Problem], StepRecord, Rewards, dict[str, float]]:
    """Sample and score ``problems``; with ``dynamic_sampling``, draw again (every rank as long as any
    rank lacks groups, at most ``max_resample`` times) and keep as many groups as ``problems`` held:
    those whose rewards differ first, in draw order, then equal-reward ones. Metrics: groups drawn
    and groups with differing rewards kept, summed over ranks."""
    record, rewards = draw(problems)
    cfg, size = run.cfg, run.cfg.group_size
    if not cfg.dynamic_sampling:
        return problems, record, rewards, {}
    pool, parts = list(problems), [(record, rewards)]
    wanted, found = len(problems) // size, int(informative(rewards.total, size).sum())
    while len(parts) <= cfg.max_resample and int(run.ranks.total(torch.tensor(max(wanted - found, 0)))) > 0:
        extra = resampled_problems(run, step, len(parts))
        parts.append(draw(extra))
        pool += extra
        found += int(informative(parts[-1][1].total, size).sum())
    rewards = Rewards.cat([s for _, s in parts])
    useful = informative(rewards.total, size)
    groups = torch.cat([useful.nonzero()[:, 0], (~useful).nonzero()[:, 0]])[:wanted]
    rows = (groups[:, None] * size + torch.arange(size)).flatten()
    record = StepRecord.cat([r for r, _ in parts]).take(rows)
    record.group_ids = group_ids(len(rows), size)
    kept = int(useful[groups].sum())
    totals = run.ranks.total(torch.tensor([float(len(pool) // size), float(kept)]))
    return [pool[i] for i in rows.tolist()], record, rewards.take(rows), {
        "groups_drawn": float(totals[0]), "groups_kept": float(totals[1])}
