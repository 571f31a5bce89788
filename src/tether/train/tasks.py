"""Tasks for ``tether train``: seeded problem streams with verifiable rewards.

A ``Task`` is a record of plain callables; a user task is a Python file defining
``TASK = Task(...)`` (or ``make_task()``), passed as ``--task path/to/file.py``. Problem ``i``
is a pure function of ``(seed, i)``, so the data cursor is one integer and resume is exact; the
held-out set comes from its own seed and is removed from the training stream.

The default ``arithmetic`` asks sums and differences of integers from 1 to 20. Reward: 1.0 when
the response's last integer is the answer, plus 0.1 when the response ends within 40 characters
of it. A task with ``tool_use`` runs multi-turn rollouts (``arithmetic-tools``, in
``tether.train.tool_task``). A callable returning the wrong type raises ``TaskError`` naming
the task, the callable and its file.
"""

from __future__ import annotations

import importlib.util
import random
import re
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Chat = list[dict[str, str]]


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


def _arithmetic_tools() -> Task:
    from tether.train.tool_task import arithmetic_tools  # it builds on this module

    return arithmetic_tools()


TASKS: dict[str, Callable[[], Task]] = {"arithmetic": arithmetic, "arithmetic-tools": _arithmetic_tools}


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
