"""Where a run's prompts come from: tasks and the multi-turn tool task.

A ``Task`` is a record of plain callables; a user task is a Python file defining
``TASK = Task(...)`` (or ``make_task()``), passed as ``--task path/to/file.py``. Problem ``i``
is a pure function of ``(seed, i)``, so the data cursor is one integer and resume is exact; the
held-out set comes from its own seed and is removed from the training stream. A callable
returning the wrong type raises ``TaskError`` naming the task, the callable and its file.

The default ``arithmetic`` asks sums and differences of integers from 1 to 20. Reward: 1.0 when
the response's last integer is the answer, plus 0.1 when the response ends within 40 characters
of it. A task with ``tool_use`` runs multi-turn episodes (``tool_rollout`` in a step,
``make_tool_rollout`` in evaluation); ``arithmetic-tools`` is the shipped one. Dataset files
(``--dataset PATH``) are ``tether.train.data``'s.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import re
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # imported where used: a task file and the command line import this module without the models
    from tether.models import TransformersWrapper
    from tether.rollout import MultiTurnRollout

Chat = list[dict[str, str]]
# The config value prefix of data and reward functions handed over as Python objects
# (``tether.train.train``), e.g. ``dataset: "python:10 rows"``; a resume must hand them over again.
IN_MEMORY = "python:"


class TaskError(TypeError):
    """A task file or one of a task's callables gave something of the wrong type."""


def _where(fn: Any) -> str:
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", repr(fn))
    return f"{name} in {code.co_filename}" if code is not None else name


@dataclass(frozen=True)
class Problem:
    """One prompt with what is needed to score answers to it."""

    chat: Chat
    answer: str
    key: str  # identity used to keep evaluation problems out of the training stream
    columns: dict[str, Any] = field(default_factory=dict)  # what reward functions get besides the texts
    text: str | None = None  # the raw prompt of --prompt-format text (chat is then its one user turn)

    def prompt(self, prompt_format: str) -> Chat | str | None:
        """What the sampler reads: the chat for ``chat`` prompts, the raw text for ``text`` ones."""
        return self.chat if prompt_format == "chat" else self.text


@dataclass(frozen=True)
class ToolUse:
    """How a task's episodes run: tool names (``tether.rollout.TOOLS``), the most assistant
    messages per episode, and the most tokens per conversation (None: no budget)."""

    tools: tuple[str, ...] = ("calculator",)
    max_turns: int = 3
    max_tokens: int | None = None


@dataclass(frozen=True)
class Task:
    """A problem generator, a reward and a correctness check, as plain callables."""

    name: str
    make_problem: Callable[[random.Random], Problem]
    reward: Callable[[str, Problem], float]
    is_correct: Callable[[str, Problem], bool]
    eval_seed: int = 10_007
    info: dict[str, Any] = field(default_factory=dict)
    tool_use: ToolUse | None = None

    def eval_set(self, n: int) -> list[Problem]:
        """``n`` distinct held-out problems (as many as exist if fewer)."""
        rng = random.Random(f"eval-{self.eval_seed}")
        seen: dict[str, Problem] = {}
        for _ in range(50 * max(n, 1)):
            if len(seen) == n:
                break
            p = self.new_problem(rng)
            seen.setdefault(p.key, p)
        return list(seen.values())

    def new_problem(self, rng: random.Random) -> Problem:
        """``make_problem(rng)``, checked to be a ``Problem``."""
        p = self.make_problem(rng)
        return self._checked("make_problem", p, isinstance(p, Problem), "a tether.train.tasks.Problem")

    def reward_value(self, value: Any) -> float:
        """A value ``reward`` returned, as a float (a number, not a dict or a string)."""
        return float(self._checked("reward", value, hasattr(type(value), "__float__"), "a real number"))

    def correct_value(self, value: Any) -> bool:
        """A value ``is_correct`` returned, as a bool."""
        return bool(self._checked("is_correct", value, hasattr(type(value), "__float__"), "a bool"))

    def _checked(self, fn_name: str, value: Any, ok: bool, expected: str) -> Any:
        if ok:
            return value
        raise TaskError(
            f"task {self.name!r}: {fn_name} ({_where(getattr(self, fn_name))}) returned "
            f"{type(value).__name__} {reprlib.repr(value)}, expected {expected}; fix that function."
        )

    def train_problem(self, seed: int, index: int, exclude: set[str]) -> Problem:
        """Problem ``index`` of the training stream, never one whose key is in ``exclude``."""
        rng = random.Random(f"train-{seed}-{index}")
        for _ in range(1000):
            p = self.new_problem(rng)
            if p.key not in exclude:
                return p
        raise ValueError(
            f"task {self.name!r}: could not draw a training problem outside the held-out set "
            "after 1000 tries; lower --eval-size or widen the task."
        )


_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> tuple[int, int] | None:
    """The last integer in ``text`` and the index just after it, or None."""
    matches = list(_INT.finditer(text.replace(",", "")))
    if not matches:
        return None
    m = matches[-1]
    return int(m.group()), m.end()


def _arithmetic_problem(rng: random.Random) -> Problem:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    if rng.random() < 0.5:
        op, value = "+", a + b
    else:
        a, b = max(a, b), min(a, b)
        op, value = "-", a - b
    question = f"What is {a} {op} {b}?"
    return Problem(chat=[{"role": "user", "content": question}], answer=str(value), key=f"{a}{op}{b}",
                   columns={"answer": str(value)})


def last_integer_correct(response: str, problem: Problem) -> bool:
    """Whether the last integer of ``response`` is ``problem.answer``."""
    found = last_integer(response)
    return found is not None and str(found[0]) == problem.answer


def _arithmetic_reward(response: str, problem: Problem) -> float:
    found = last_integer(response)
    if found is None:
        return 0.0
    correct = 1.0 if str(found[0]) == problem.answer else 0.0
    concise = 0.1 if len(response.rstrip()) - found[1] <= 40 else 0.0
    return correct + concise


def arithmetic() -> Task:
    return Task(
        name="arithmetic",
        make_problem=_arithmetic_problem,
        reward=_arithmetic_reward,
        is_correct=last_integer_correct,
        info={"reward": "1 if the last integer is the answer, +0.1 if the reply ends within 40 chars of it"},
    )


# ------------------------------------------------------------------------------ arithmetic-tools
# Multi-digit products (``a`` in [100, 999], ``b`` in [10, 99]) that a 135M model gets wrong unless it
# calls the calculator, in one of ``PHRASINGS``. The system prompt describes the ``calculator`` tool and
# the ``<tool_call>`` format (``tether.rollout.tool_calls``), and one worked episode for a bare "What is
# a * b?" precedes the question. Reward: 1.0 when the last integer of the last assistant message is the
# product, else 0 (no format bonus: the tool is only worth calling because it gets the number right);
# the held-out score is the same check. An episode holds at most 3 assistant messages and 512 tokens
# (``--max-turns``, ``--max-episode-tokens``). Why this mix, as measured on SmolLM2-135M-Instruct: the
# worked example alone with its own phrasing is copied (14 of 16 right greedily, nothing left to learn),
# no example gets no product right (no signal); the example and varied phrasings leave room between.
SYSTEM_PROMPT = (
    "You are a careful assistant with a calculator. To compute, reply with only a tool call:\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>\n'
    "The result comes back in a tool message. Then reply with the final answer as a number."
)


# One worked episode before the question: a 135M model copies a demonstration far more
# readily than it follows an instruction. It is prompt, never trained on.
EXAMPLE = [
    {"role": "user", "content": "What is 512 * 37?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "512 * 37"}}</tool_call>'},
    {"role": "tool", "content": "18944"},
    {"role": "assistant", "content": "18944"},
]

# Only the first is the example's shape; the others make the model map words to an expression.
PHRASINGS = (
    "What is {a} * {b}?",
    "Multiply {a} by {b}.",
    "What is the product of {a} and {b}?",
    "A box holds {b} rows of {a} beads. How many beads are in the box?",
    "Compute {a} times {b}.",
)


def _product_problem(rng: random.Random) -> Problem:
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    question = rng.choice(PHRASINGS).format(a=a, b=b)
    chat = [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLE, {"role": "user", "content": question}]
    return Problem(chat=chat, answer=str(a * b), key=f"{a}*{b}", columns={"answer": str(a * b)})


def _reward(response: str, problem: Problem) -> float:
    return 1.0 if last_integer_correct(response, problem) else 0.0


def arithmetic_tools() -> Task:
    return Task(
        name="arithmetic-tools",
        make_problem=_product_problem,
        reward=_reward,
        is_correct=last_integer_correct,
        info={"reward": "1 if the last integer of the final answer is the product a * b, else 0",
              "tools": "calculator"},
        tool_use=ToolUse(tools=("calculator",), max_turns=3, max_tokens=512),
    )


# ------------------------------------------------------------------------------ the registry and task files
TASKS: dict[str, Callable[[], Task]] = {"arithmetic": arithmetic, "arithmetic-tools": arithmetic_tools}


def load_user_module(path: Path, argument: str) -> Any:
    """Run the user's Python file ``path`` (named by the config key ``argument``) as a module."""
    spec = importlib.util.spec_from_file_location(f"tether_user_{argument}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's code: one line naming the file, not a traceback
        raise ValueError(f"{argument}: running {path} raised {type(exc).__name__}: {exc}; fix the file.") from exc
    return module


def load_task(name_or_path: str) -> Task:
    """A registered task by name, or the ``TASK`` / ``make_task()`` of a Python file."""
    if name_or_path in TASKS:
        return TASKS[name_or_path]()
    path = Path(name_or_path)
    if path.suffix != ".py" or not path.is_file():
        raise ValueError(
            f"task: expected one of {sorted(TASKS)} or a path to a .py file, got {name_or_path!r}."
        )
    module = load_user_module(path, "task")
    task = getattr(module, "TASK", None)
    if task is None and callable(getattr(module, "make_task", None)):
        task = module.make_task()
    if not isinstance(task, Task):
        raise TaskError(
            f"task file {path}: expected a module-level TASK = tether.train.tasks.Task(...) or a "
            f"make_task() returning one, got {type(task).__name__}."
        )
    return task


# ------------------------------------------------------------------------------ tool episodes
# The recipe calls three things from here and is otherwise unchanged: ``with_episode_limits`` puts the
# run's ``max_turns`` / ``max_episode_tokens`` into the task's ``ToolUse`` at start-up, ``tool_rollout``
# replaces the single-turn sampling of a step (the batch carries the same keys, with the assistant mask
# covering every assistant message and the log-probs recorded at sampling), and ``tool_metrics`` adds the
# step's tool statistics to its metrics line. Evaluation runs the same rollout with greedy decoding through
# ``make_tool_rollout``; Ray rollout workers run it with the task's ``ToolUse`` (``recipe_ray.start_workers``).
def make_tool_rollout(task: Task, sampler: TransformersWrapper) -> MultiTurnRollout | None:
    """The task's multi-turn rollout over ``sampler``, or None for a single-turn task."""
    from tether.rollout import MultiTurnRollout

    use = task.tool_use
    if use is None:
        return None
    return MultiTurnRollout(sampler, list(use.tools), max_turns=use.max_turns, max_tokens=use.max_tokens)


def with_episode_limits(task: Task, cfg: Any, tokenizer: Any) -> Task:
    """``task`` with ``cfg.max_turns`` / ``cfg.max_episode_tokens`` in its ``ToolUse`` (0 keeps the task's).

    Checked at start-up: the limits are refused for a single-turn task (they would do nothing),
    and the token budget must leave room to answer every held-out prompt (``cfg.eval_size``).
    """
    from tether.models.chat import render_chat_ids

    given = {k: v for k, v in (("max_turns", cfg.max_turns), ("max_tokens", cfg.max_episode_tokens)) if v}
    if task.tool_use is None:
        if given:
            raise ValueError(
                f"max_turns={cfg.max_turns}, max_episode_tokens={cfg.max_episode_tokens}: task {task.name!r} is "
                "single-turn, so episode limits would do nothing; set both to 0 or use a tool task "
                "(--task arithmetic-tools)."
            )
        return task
    use = dataclasses.replace(task.tool_use, **given)
    if use.max_tokens is not None:
        held_out = task.eval_set(cfg.eval_size)
        lengths = [len(render_chat_ids(tokenizer, p.chat, add_generation_prompt=True)) for p in held_out]
        longest, index = max(zip(lengths, range(len(lengths))), default=(0, -1))
        if longest >= use.max_tokens:
            raise ValueError(
                f"max_episode_tokens: a budget of {use.max_tokens} tokens leaves no room to answer held-out "
                f"problem {index}, whose prompt renders to {longest} tokens; raise it well above {longest} "
                "(or set 0 to keep the task's own)."
            )
    return dataclasses.replace(task, tool_use=use)


def tool_rollout(run: Any, problems: list[Problem]):
    """Sample one episode per problem (already repeated ``group_size`` times) with the run's sampler."""
    from tether.llm import chat_batch

    rollout = make_tool_rollout(run.task, run.sampler)
    batch = chat_batch([p.chat for p in problems], key=("history", "prompt"))
    with torch.no_grad():
        rollout(batch)
    return batch


def tool_metrics(episode: Any) -> dict[str, float]:
    """``tool_call_rate``, ``tool_calls_per_episode``, ``tool_error_rate``, ``turns_per_episode``
    of a multi-turn batch's ``[B]`` episode counters (``td["episode"]`` or ``StepRecord.episode``);
    nothing for a single-turn batch (no counters)."""
    from tether.rollout import episode_metrics

    return episode_metrics(episode) if episode is not None and "turns" in episode.keys() else {}


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


def prompt_batch(problems: list[Problem], prompt_format: str):
    """The sampler's input: ``("history", "prompt")`` chats or ``("text", "prompt")`` strings."""
    from tensordict import TensorDict

    from tether.llm import chat_batch
    from tether.models.batch_io import write_objects

    if prompt_format == "chat":
        return chat_batch([p.prompt(prompt_format) for p in problems], key=("history", "prompt"))
    td = TensorDict(batch_size=[len(problems)])
    write_objects(td, ("text", "prompt"), [p.prompt(prompt_format) for p in problems])
    return td
