"""Dataset files as a task: ``--dataset PATH`` read offline into a ``DatasetTask``.

Every row is trained on once per epoch, each epoch in an order seeded by ``(seed, epoch)``; the
held-out rows (``--eval-dataset`` or ``--eval-split``) are kept apart (``docs/data.md``). Also
here: what ``TrainConfig.validate`` reports about the data and reward keys, the resume check that
the rows did not change, and the ``prompt_format`` choices.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.train.jsonl import JsonlLineError, read_jsonl
from tether.train.tasks import IN_MEMORY, Problem


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
