"""The periodic evaluation: every ``eval_every`` steps the held-out accuracy, and the best so far.

``periodic_eval`` scores the policy greedily on the held-out set (with the run's reward and the
sampled KL beside it) into that step's metrics; ``BestEval`` remembers the best step, which the
loop then keeps as a full checkpoint under ``RUN/best/`` (``tether.train.run_dir.best_root``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tether.train.metrics import due, eval_seed, evaluate, held_out_metrics, sampled_kl


# ------------------------------------------------------------------------------ the best checkpoint
# The periodic evaluation scores the policy greedily on the held-out set and logs ``eval_accuracy``
# in that step's metrics. A new best (ties keep the earlier step) writes the step's full checkpoint
# to ``RUN/best/checkpoints/step_NNNNNN/``, in the format and with the manifest of ``RUN/checkpoints/``
# (only one is kept). The best so far is part of every regular checkpoint's state, so a resumed run
# keeps comparing against it.


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


def periodic_eval(run: Any, done: int, record: dict[str, Any]) -> bool:
    """Every ``eval_every`` steps: ``eval_accuracy`` into the step's ``record``; True on a new best."""

    cfg = run.cfg
    if not due(cfg.eval_every, done):
        return False
    result = evaluate(run.models.policy, None, run.models.tokenizer, run.task, run.held_out,
                      max_new_tokens=cfg.eval_max_new_tokens, temperature=cfg.temperature, with_kl=False,
                      reward=run.reward, prompt_format=cfg.prompt_format)
    record["eval_accuracy"] = result.accuracy
    if result.reward is not None:  # the held-out reward (and each function's) beside it, as after training
        record.update({key: value for key, value in held_out_metrics(result.as_dict(), with_kl=False).items()
                       if key.startswith("eval_reward")})
    if run.held_out:
        record["eval_kl_sampled_per_seq"] = sampled_kl(
            run.models.policy, run.models.reference, run.models.tokenizer, run.task, run.held_out,
            max_new_tokens=cfg.eval_max_new_tokens, temperature=cfg.temperature, prompt_format=cfg.prompt_format,
            seed=eval_seed(cfg.seed, done))
    return run.best.offer(done, record["eval_accuracy"])
