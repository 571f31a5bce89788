"""Where a run's prompts come from: tasks, the multi-turn tool task, and dataset files.

A ``Task`` is a record of plain callables; a user task is a Python file defining
``TASK = Task(...)`` (or ``make_task()``), passed as ``--task path/to/file.py``. Problem ``i``
is a pure function of ``(seed, i)``, so the data cursor is one integer and resume is exact; the
held-out set comes from its own seed and is removed from the training stream. A callable
returning the wrong type raises ``TaskError`` naming the task, the callable and its file.

The default ``arithmetic`` asks sums and differences of integers from 1 to 20. Reward: 1.0 when
the response's last integer is the answer, plus 0.1 when the response ends within 40 characters
of it. A task with ``tool_use`` runs multi-turn episodes (``tool_rollout`` in a step,
``make_tool_rollout`` in evaluation); ``arithmetic-tools`` is the shipped one. ``--dataset
PATH`` makes a ``DatasetTask`` of a file's rows, read offline with the ``datasets`` library:
every row once per epoch, each epoch in an order seeded by ``(seed, epoch)``, and the held-out
rows kept apart (``docs/data.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import random
import re
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tether.train.jsonl import JsonlLineError, read_jsonl

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


# ------------------------------------------------------------------------------ datasets
# Files are read with the ``datasets`` library, offline: ``.jsonl``/``.json``, ``.csv``, ``.parquet``, or a
# directory written by ``Dataset.save_to_disk`` (a saved ``DatasetDict`` with one split, or one split's own
# sub-directory). ``--prompt-column`` holds either chat messages (a list of ``{"role", "content"}``) or
# plain text; every other column is kept with the row and reaches the reward functions. ``--prompt-format
# chat`` renders prompts with the tokenizer's chat template (a plain-text prompt becomes one user turn);
# ``text`` feeds the text to the tokenizer as it is, for base models without a chat template.
# Training prompt ``i`` is row ``order_e[i mod N]`` of the ``N`` training rows, where ``e = i div N`` is
# the epoch and ``order_e`` a shuffle seeded by ``(seed, e)``. The held-out rows are all of
# ``--eval-dataset``, or ``round(FRACTION x rows)`` rows taken out by ``--eval-split`` with a shuffle
# that depends on the rows only (not on ``--seed``): runs with different seeds are scored on the same
# rows and never train on them.

# How a prompt reaches the model (the prompt_format config choice).
PROMPT_FORMATS: dict[str, str] = {
    "chat": "rendered with the tokenizer's chat template (plain text becomes one user turn)",
    "text": "encoded as it is, for base models without a chat template",
}
_READERS = {".jsonl": "from_json", ".json": "from_json", ".csv": "from_csv", ".parquet": "from_parquet"}
_SPLIT_SEED = "tether-eval-split"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class DatasetTask:
    """Training rows drawn by seeded epochs, and held-out rows kept apart (see the module doc)."""

    name: str
    train: tuple[Problem, ...]
    held_out: tuple[Problem, ...]
    fingerprint: str  # sha256 of the rows as read, so a resume can refuse changed data
    info: dict[str, Any] = field(default_factory=dict)
    tool_use: None = None  # dataset prompts are single-turn (see tether.train.tasks.Task.tool_use)

    def train_problem(self, seed: int, index: int, exclude: Any = ()) -> Problem:
        """Training prompt ``index`` for ``seed``; held-out rows are apart already, so ``exclude`` is unused."""
        epoch, position = divmod(index, len(self.train))
        return self.train[_epoch_order(seed, epoch, len(self.train))[position]]

    def eval_set(self, n: int) -> list[Problem]:
        """The first ``n`` held-out rows (all of them if fewer)."""
        return list(self.held_out[:n])


@functools.lru_cache(maxsize=8)
def _epoch_order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(f"data-{seed}-{epoch}").shuffle(order)
    return tuple(order)


def read_rows(path: str, argument: str) -> list[dict[str, Any]]:
    """The rows of a JSONL/CSV/Parquet file, a saved dataset directory or a cached Hub dataset, as dicts."""
    import datasets

    from tether.models.loading import hub_snapshot

    datasets.disable_progress_bars()
    source = Path(path)
    if not source.exists() and _looks_like_hub_id(path):
        source = hub_snapshot(path, argument, expected="a local data file or directory, or a Hub dataset id",
                              repo_type="dataset")
        loaded = _load_hub_snapshot(path, source, argument)
    elif not source.exists():
        raise ValueError(f"{argument}: {path} does not exist; give a .jsonl, .csv or .parquet file or a "
                         "directory written by Dataset.save_to_disk.")
    elif source.is_dir():
        loaded = _load_saved(source, argument)
    else:
        reader = _READERS.get(source.suffix.lower())
        if reader is None:
            raise ValueError(f"{argument}: {path} has the suffix {source.suffix!r}, expected one of "
                             f"{sorted(_READERS)} or a saved dataset directory; convert the file or rename it.")
        if source.stat().st_size == 0:  # datasets raises a bare StopIteration on an empty file
            raise ValueError(f"{argument}: {path} holds no rows; give a dataset with at least one prompt.")
        if source.suffix.lower() == ".jsonl":  # datasets names no line: a line that does not parse is named here
            try:
                read_jsonl(source, unfinished_last=False)
            except JsonlLineError as exc:
                raise ValueError(f"{argument}: cannot read {path} as .jsonl (line {exc.line} is not valid JSON: "
                                 f"{exc.reason}); fix the file.") from None
        try:
            loaded = getattr(datasets.Dataset, reader)(str(source), keep_in_memory=True)
        except Exception as exc:  # datasets wraps parse errors in its own types; the cause names the fault
            cause = exc.__cause__ or exc
            raise ValueError(f"{argument}: cannot read {path} as {source.suffix} ({type(cause).__name__}: "
                             f"{cause}); fix the file.") from exc
    rows = loaded.to_list()
    if not rows:
        raise ValueError(f"{argument}: {path} holds no rows; give a dataset with at least one prompt.")
    return rows


def _load_hub_snapshot(spec: str, snapshot: Path, argument: str):
    """The ``train`` split of a cached Hub dataset, read from its snapshot's files (no network)."""
    import datasets

    try:
        return datasets.load_dataset(str(snapshot), split="train", keep_in_memory=True)
    except ValueError as exc:  # several configs, or no train split: datasets says which there are
        raise ValueError(
            f"{argument}: the cached Hub dataset {spec} ({snapshot}) has no single train split to read ({exc}); "
            "save the config and split you want to a file, e.g. python -c \"import datasets; "
            f"datasets.load_dataset('{spec}', CONFIG, split=SPLIT).to_json('{Path(spec).name}.jsonl')\", "
            f"and pass --{argument.replace('_', '-')} {Path(spec).name}.jsonl."
        ) from exc


def _looks_like_hub_id(path: str) -> bool:
    """``owner/name`` with no file suffix tether reads: a Hub dataset id rather than a mistyped path."""
    return bool(_HUB_ID.fullmatch(path)) and Path(path).suffix.lower() not in _READERS


def _load_saved(source: Path, argument: str):
    import datasets

    try:
        loaded = datasets.load_from_disk(str(source), keep_in_memory=True)
    except Exception as exc:
        raise ValueError(f"{argument}: {source} is a directory but not one written by save_to_disk ({exc}); "
                         "give a dataset file or a saved dataset directory.") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if len(loaded) != 1:
            raise ValueError(f"{argument}: {source} holds the splits {sorted(loaded)}; give one split's "
                             f"directory, e.g. {source / sorted(loaded)[0]}.")
        loaded = next(iter(loaded.values()))
    return loaded


def rows_to_problems(rows: list[dict[str, Any]], prompt_column: str, prompt_format: str,
                     source: str) -> list[Problem]:
    """One ``Problem`` per row: the prompt from ``prompt_column``, the other columns kept."""
    if prompt_column not in rows[0]:
        raise KeyError(f"prompt_column: {source} has no column {prompt_column!r} (its columns: "
                       f"{sorted(rows[0])}); pass --prompt-column with one of them.")
    from tether.models.chat import validate_chats

    problems = []
    for i, row in enumerate(rows):
        prompt = row[prompt_column]
        columns = {k: v for k, v in row.items() if k != prompt_column}
        where = f"{source} row {i}, column {prompt_column!r}"
        if isinstance(prompt, str):
            chat = [{"role": "user", "content": prompt}]
            problems.append(Problem(chat=chat, answer="", key=f"{source}#{i}", columns=columns,
                                    text=prompt if prompt_format == "text" else None))
        elif isinstance(prompt, list):
            if prompt_format == "text":
                raise ValueError(f"prompt_format: {where} holds chat messages, but --prompt-format text takes "
                                 "plain-text prompts; pass --prompt-format chat.")
            chat = validate_chats([prompt], name=where)[0]
            problems.append(Problem(chat=chat, answer="", key=f"{source}#{i}", columns=columns))
        else:
            raise TypeError(f"prompt_column: {where} is {type(prompt).__name__} {prompt!r}, expected a string "
                            "or a list of {'role', 'content'} messages; fix the row or choose another column.")
    return problems


def split_rows(problems: list[Problem], fraction: float) -> tuple[list[Problem], list[Problem]]:
    """``(train, held_out)``: ``round(fraction x N)`` rows held out by a shuffle seeded by the rows."""
    n_eval = round(fraction * len(problems))
    if n_eval < 1 or n_eval >= len(problems):
        raise ValueError(f"eval_split: {fraction} of {len(problems)} rows holds out {n_eval} rows, which "
                         f"leaves {len(problems) - n_eval} to train on; both must be at least 1. Choose a "
                         "fraction between those bounds or pass --eval-dataset.")
    order = list(range(len(problems)))
    random.Random(_SPLIT_SEED).shuffle(order)
    held = set(order[:n_eval])
    return ([p for i, p in enumerate(problems) if i not in held],
            [problems[i] for i in order[:n_eval]])


def _fingerprint(*row_lists: list[dict[str, Any]]) -> str:
    text = json.dumps(row_lists, sort_keys=True, default=repr).encode()
    return hashlib.sha256(text).hexdigest()


def dataset_task(cfg: Any, rows: list[dict[str, Any]] | None = None,
                 eval_rows: list[dict[str, Any]] | None = None) -> DatasetTask:
    """The ``DatasetTask`` of ``cfg.dataset`` with its held-out rows (``eval_dataset`` or ``eval_split``);
    ``rows`` / ``eval_rows``: those datasets' rows when they were given as Python objects."""
    rows = read_rows(cfg.dataset, "dataset") if rows is None else rows
    problems = rows_to_problems(rows, cfg.prompt_column, cfg.prompt_format, Path(cfg.dataset).name)
    if cfg.eval_dataset:
        eval_rows = read_rows(cfg.eval_dataset, "eval_dataset") if eval_rows is None else eval_rows
        train, held_out = problems, rows_to_problems(eval_rows, cfg.prompt_column, cfg.prompt_format,
                                                     Path(cfg.eval_dataset).name)
    elif cfg.eval_split:
        train, held_out = split_rows(problems, cfg.eval_split)
    else:
        train, held_out = problems, []
    info = {"rows": len(rows), "train_rows": len(train), "held_out_rows": len(held_out)}
    return DatasetTask(name=Path(cfg.dataset).name, train=tuple(train), held_out=tuple(held_out),
                       fingerprint=_fingerprint(rows, eval_rows or [], [cfg.eval_split]), info=info)


def config_problems(cfg: Any) -> list[str]:
    """What ``TrainConfig.validate`` reports about the data and reward keys."""
    p = []
    if not 0 <= cfg.eval_split < 1:
        p.append(f"eval_split: expected a fraction in [0, 1), got {cfg.eval_split}")
    if cfg.eval_split and cfg.eval_dataset:
        p.append("eval_split and eval_dataset: give one source of held-out rows, not both")
    if not cfg.dataset:
        for name in ("eval_dataset", "eval_split"):
            if getattr(cfg, name):
                p.append(f"{name}: holds out rows of --dataset, but no dataset is given; pass --dataset PATH")
        if cfg.prompt_format == "text":
            p.append("prompt_format: 'text' applies to --dataset prompts (the tasks write chats); pass --dataset PATH")
    else:
        if cfg.task != "arithmetic":
            p.append(f"task and dataset: give one source of prompts, got task={cfg.task!r} and dataset={cfg.dataset!r}")
        if not (cfg.reward_funcs or cfg.reward_model):
            p.append("dataset: a dataset run needs a reward; pass --reward-funcs FILE.py and/or --reward-model DIR")
    if cfg.reward_funcs and not cfg.reward_funcs.startswith(IN_MEMORY) and not (
            cfg.reward_funcs.endswith(".py") and Path(cfg.reward_funcs).is_file()):
        p.append(f"reward_funcs: expected an existing .py file, got {cfg.reward_funcs!r}")
    if cfg.reward_model and not Path(cfg.reward_model).is_dir():
        p.append(f"reward_model: expected a local model directory, got {cfg.reward_model!r} (nothing is downloaded)")
    if cfg.reward_weights and not (cfg.reward_funcs or cfg.reward_model):
        p.append("reward_weights: weigh --reward-funcs / --reward-model, but neither is given")
    if cfg.workers and cfg.prompt_format == "text":
        p.append("prompt_format: 'text' is not supported with workers > 0 (the Ray workers sample chats); use workers=0")
    return p


def check_data(state: dict[str, Any], task: Any, checkpoint: Path) -> None:
    """Refuse to resume from a checkpoint trained on other rows than the dataset reads now."""
    recorded, now = state.get("data"), getattr(task, "fingerprint", None)
    if recorded != now:
        raise ValueError(f"dataset: {checkpoint} was trained on data with fingerprint {str(recorded)[:12]}, but "
                         f"the dataset files now read as {str(now)[:12]}; restore the files the run was started "
                         "with, or start a new run.")


def check_prompt_format(prompt_format: str, tokenizer: Any, model: str) -> None:
    """Refuse ``chat`` prompts for a tokenizer without a chat template, before anything runs."""
    if prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"prompt_format: 'chat' renders prompts with the tokenizer's chat template, but model "
                         f"{model!r} has none; pass --prompt-format text with a plain-text --prompt-column.")


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
