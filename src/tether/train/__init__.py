"""Recipes: the GRPO training loop, tasks, config and the ``tether`` command line.

``train(config, *, dataset=, reward_funcs=, ...)`` is the Python front door a TRL user knows: an
in-memory ``datasets.Dataset`` or list of dicts, plain reward callables
``f(prompts, completions, **columns) -> list[float | None]``, a model path or a loaded model. It
runs the recipe ``tether train`` runs, into the same run directory.
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path
from typing import Any, Sequence

__all__ = ["train"]


def train(config: Any = None, *, dataset: Any = None, reward_funcs: Any = None,
          reward_weights: Sequence[float] | str | None = None, eval_dataset: Any = None, model: Any = None,
          tokenizer: Any = None, resume: bool = False, progress: bool = True, **overrides: Any) -> dict[str, Any]:
    """Train (or resume) a run with the recipe of ``tether train``; returns its summary.

    Args:
        config: a ``TrainConfig``, a dict of its fields (TRL's ``GRPOConfig`` names are read too),
            a YAML file, or None for the defaults.
        dataset, eval_dataset: a ``datasets.Dataset`` or a list of dicts (rows with a prompt
            column), or a file path as ``--dataset`` takes.
        reward_funcs: a callable, a list of them, or a ``.py`` file path (``--reward-funcs``).
        reward_weights: one weight per reward function.
        model: a model directory or name (``--model``), or a loaded ``PreTrainedModel``, which
            is saved with ``tokenizer`` next to the run directory (``<out>.base-model``).
        resume: continue the run in ``config.out``; Python data and rewards are handed over again.
        overrides: further ``TrainConfig`` fields, e.g. ``steps=8``.
    """
    from tether.train.config import TrainConfig
    from tether.train.recipe import train as run_recipe
    from tether.train.rewards import RewardFunction
    from tether.train.run import Inputs, build_run
    from tether.train.tasks import IN_MEMORY

    if config is None or isinstance(config, dict):
        cfg = TrainConfig.from_dict(config or {})
    elif isinstance(config, (str, PathLike)):
        cfg = TrainConfig.from_yaml(config)
    elif isinstance(config, TrainConfig):
        cfg = config
    else:
        raise TypeError(f"config: expected a TrainConfig, a dict of its fields, a YAML path or None, got "
                        f"{type(config).__name__}.")
    values: dict[str, Any] = dict(overrides)
    rows, values["dataset"] = _data(dataset, "dataset", cfg.dataset, IN_MEMORY)
    eval_rows, values["eval_dataset"] = _data(eval_dataset, "eval_dataset", cfg.eval_dataset, IN_MEMORY)
    functions = None
    if reward_funcs is None or isinstance(reward_funcs, (str, PathLike)):
        values["reward_funcs"] = cfg.reward_funcs if reward_funcs is None else str(reward_funcs)
    else:
        given = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not given or not all(callable(f) for f in given):
            raise TypeError(f"reward_funcs: expected a callable f(prompts, completions, **columns) -> list[float], a "
                            f"non-empty list of them or a .py file path, got {reward_funcs!r}.")
        functions = [RewardFunction(getattr(f, "__name__", type(f).__name__), f, "python") for f in given]
        values["reward_funcs"] = IN_MEMORY + ",".join(f.name for f in functions)
    if reward_weights is not None:
        values["reward_weights"] = (reward_weights if isinstance(reward_weights, str)
                                    else ",".join(repr(float(w)) for w in reward_weights))
    if model is not None:
        values["model"] = (str(model) if isinstance(model, (str, PathLike))
                           else _saved_model(model, tokenizer, Path(values.get("out", cfg.out)), fresh=not resume))
    cfg = cfg.override(values)
    run = build_run(cfg, fresh=not resume, inputs=Inputs(rows, eval_rows, functions))
    return run_recipe(cfg, resume=resume, progress=progress, run=run)


def _data(data: Any, argument: str, current: str, prefix: str) -> tuple[list[dict[str, Any]] | None, str]:
    """``(rows, config value)`` of a dataset argument: rows for Python data, a path as given."""
    if data is None:
        return None, current
    if isinstance(data, (str, PathLike)):
        return None, str(data)
    rows = data.to_list() if callable(getattr(data, "to_list", None)) else data  # a datasets.Dataset
    if not isinstance(rows, (list, tuple)) or not rows or not all(isinstance(r, dict) for r in rows):
        raise TypeError(f"{argument}: expected a datasets.Dataset, a non-empty list of dicts (one row each) or a "
                        f"file path, got {type(data).__name__}.")
    return [dict(r) for r in rows], f"{prefix}{len(rows)} rows"


def _saved_model(model: Any, tokenizer: Any, out: Path, *, fresh: bool) -> str:
    """A loaded model (and its tokenizer) saved beside the run directory (a resume reads it back); its path."""
    if not callable(getattr(model, "save_pretrained", None)) or tokenizer is None:
        raise TypeError(f"model: expected a model directory or name, or a loaded PreTrainedModel together with "
                        f"tokenizer=, got {type(model).__name__} and tokenizer={type(tokenizer).__name__}.")
    directory = out.with_name(out.name + ".base-model")
    if fresh or not (directory / "config.json").is_file():
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return str(directory)
