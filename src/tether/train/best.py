"""Periodic held-out evaluation (``eval_every``) and the best checkpoint it keeps.

Every ``eval_every`` steps the policy is scored greedily on the held-out set; the accuracy is
logged as ``eval_accuracy`` in that step's metrics. When it beats every earlier periodic
evaluation of the run (ties keep the earlier step), the step's full checkpoint is written to
``RUN/best/checkpoints/step_NNNNNN/`` in the format and with the manifest of
``RUN/checkpoints/`` (only one is kept), and ``tether eval RUN --best`` / ``tether export RUN
OUT --best`` load it. The best so far is part of every regular checkpoint's state, so a
resumed run keeps comparing against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

BEST_DIR = "best"


@dataclass
class BestEval:
    """The step and held-out accuracy of the best periodic evaluation so far (``None``: none yet)."""

    step: int | None = None
    accuracy: float | None = None

    def offer(self, step: int, accuracy: float) -> bool:
        """Record ``accuracy`` of ``step`` if it is the best; return whether it was."""
        if self.accuracy is not None and accuracy <= self.accuracy:
            return False
        self.step, self.accuracy = step, accuracy
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "accuracy": self.accuracy}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.step, self.accuracy = state.get("step"), state.get("accuracy")


def best_root(run_dir: Path, *, required: bool = False) -> Path:
    """The directory whose ``checkpoints/`` holds the best checkpoint of ``run_dir``; with
    ``required``, a ``ValueError`` for ``--best`` if the run kept none."""
    root = Path(run_dir) / BEST_DIR
    if required and not (root / "checkpoints").is_dir():
        raise ValueError(f"--best: {run_dir} has no best checkpoint ({root}/checkpoints); the run kept none "
                         "because it ran without eval_every. Use its latest checkpoint: leave out --best.")
    return root


def due(eval_every: int, done: int) -> bool:
    """Whether the periodic evaluation runs after ``done`` steps."""
    return bool(eval_every) and done % eval_every == 0


def periodic_eval(run: Any, done: int, record: dict[str, Any]) -> bool:
    """Every ``eval_every`` steps: ``eval_accuracy`` into the step's ``record``; True on a new best."""
    from tether.train.evaluate import evaluate

    cfg = run.cfg
    if not due(cfg.eval_every, done):
        return False
    record["eval_accuracy"] = evaluate(run.models.policy, None, run.models.tokenizer, run.task, run.held_out,
                                       max_new_tokens=cfg.eval_max_new_tokens, temperature=cfg.temperature,
                                       with_kl=False, scorer=run.scorer, prompt_format=cfg.prompt_format).accuracy
    return run.best.offer(done, record["eval_accuracy"])
