"""Experiment tracking beside ``metrics.jsonl``: TensorBoard scalars and logged completions.

``metrics.jsonl`` is always written (``tether.train.metrics.MetricsLog``). ``report_to``
picks one more sink from ``TRACKERS``: ``"none"`` or ``"tensorboard"``, whose event files
(in ``RUN/tensorboard/``) hold every numeric value of each step's record under the record's
own key, with the step as the global step. ``log_completions_every = K`` writes the first
``COMPLETION_ROWS`` rows of every K-th step's batch (a whole group first, so the spread of
rewards within a group is visible) to ``RUN/completions.jsonl``, and as a text table to the
tracker. A resume cuts both back to the checkpoint's step, as it does ``metrics.jsonl``:
``completions.jsonl`` by its ``step`` field, the event files with TensorBoard's
``purge_step``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from tether.ops.registry import lookup
from tether.train.best import due

COMPLETIONS_FILE = "completions.jsonl"
TENSORBOARD_DIR = "tensorboard"
COMPLETION_ROWS = 8


class NullTracker:
    """``report_to: none``: nothing beyond ``metrics.jsonl`` and ``completions.jsonl``."""

    def __init__(self, run_dir: Path, *, resume_step: int | None = None) -> None:
        pass

    def scalars(self, record: dict[str, Any]) -> None:
        pass

    def completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """Event files in ``RUN/tensorboard/`` through ``torch.utils.tensorboard`` (needs ``tensorboard``)."""

    def __init__(self, run_dir: Path, *, resume_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "report_to: 'tensorboard' needs the tensorboard package, which is not installed; "
                "pip install 'tether[tensorboard]' (or tensorboard), or set report_to none."
            ) from exc
        # purge_step drops the events of steps a resume recomputes, as metrics.jsonl is cut back.
        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=purge)

    def scalars(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, float(value), global_step=step)
        self.writer.flush()

    def completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text("completions", completions_markdown(rows), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


TRACKERS: dict[str, Callable[..., Any]] = {"none": NullTracker, "tensorboard": TensorBoardTracker}


def make_tracker(name: str, run_dir: Path, *, resume_step: int | None = None) -> Any:
    """The tracker ``report_to`` names (``TRACKERS``), opened on ``run_dir``."""
    return lookup(TRACKERS, name, "report_to")(run_dir, resume_step=resume_step)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def completions_markdown(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the rows (TensorBoard renders text summaries as Markdown)."""
    lines = ["| prompt | completion | reward |", "|---|---|---|"]
    lines += [f"| {_cell(r['prompt'])} | {_cell(r['completion'])} | {r['reward']:.4g} |" for r in rows]
    return "\n".join(lines)


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
        if not self.path.is_file():
            return []
        # As in metrics.jsonl, a last line without its newline is a write cut short by a kill.
        return [json.loads(line) for line in self.path.read_text().split("\n")[:-1] if line.strip()]

    def truncate_after(self, step: int) -> None:
        if self.path.is_file():
            kept = [r for r in self.read() if r["step"] <= step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
