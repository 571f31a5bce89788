"""A run's held-out evaluation and its closing summary (``summary.json``)."""

from __future__ import annotations

from typing import Any

from tether.train.evaluate import evaluate
from tether.train.rewards import RewardError, with_checkpoints
from tether.train.run import Run
from tether.train.tasks import tool_summary


def evaluate_run(run: Run, reference: Any, with_kl: bool = True) -> dict[str, Any]:
    """Held-out accuracy, reward and (``with_kl``) KL of the policy, as a dict."""
    try:
        return evaluate(run.models.policy, reference, run.models.tokenizer, run.task, run.held_out,
                        max_new_tokens=run.cfg.eval_max_new_tokens, temperature=run.cfg.temperature,
                        with_kl=with_kl, scorer=run.scorer, prompt_format=run.cfg.prompt_format).as_dict()
    except RewardError as exc:
        raise with_checkpoints(exc, run.dir) from exc


def summarize(run: Run, before: dict, after: dict, seconds: float) -> dict[str, Any]:
    """The run's summary: held-out results before and after, the KL budget, the leash's state."""
    records = run.metrics.read()
    tail = records[-3:]
    final_kl = _tail_mean(tail, "kl_per_seq") or 0.0
    return {
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
        "final_train_kl_per_seq": final_kl,
        "final_train_kl_exact_per_seq": _tail_mean(tail, "kl_exact_per_seq"),
        "kl_bound": run.cfg.kl_bound,
        "kl_within_bound": (_tail_mean(tail, "kl_exact_per_seq") or final_kl) <= run.cfg.kl_bound,
        "steps_over_kl_bound": sum(bool(r.get("kl_over_bound")) for r in records),
        "final_kl_coef": float(run.leash.kl_coef),
        "seconds_this_process": seconds,
        "eval_size": len(run.held_out),
        **({"best_eval_step": run.best.step, "best_eval_accuracy": run.best.accuracy} if run.cfg.eval_every else {}),
        **tool_summary(before, after),
    }


def _tail_mean(tail: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in tail if key in r]
    return sum(values) / len(values) if values else None
