"""``tether.train.train``: a TRL user's Python front door runs the recipe of ``tether train``.

In-memory data (a ``datasets.Dataset``), plain reward callables and a loaded model give the
same run, metric for metric and weight for weight, as the files the command line reads; a
resume hands the Python objects over again, and bad arguments name themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file

from tests.train.test_data import ROWS
from tests.train.test_recipe import tiny_cfg
from tests.train.test_rewards import REWARDS, run_cfg
from tether.models.tiny import byte_tokenizer, tiny_causal_lm
from tether.train import train
from tether.train.config import TrainConfig
from tether.train.recipe import build_run, train as run_recipe

TIMING = {"step_time", "tokens_per_s", "kl_move_seconds"}  # wall-clock figures, the only ones equal runs may differ in


def reward_callables() -> list:
    namespace: dict = {}
    exec(REWARDS, namespace)  # the same two functions the file run reads from r.py
    return [namespace["odd_share"], namespace["level_bonus"]]


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def final_weights(run: Path) -> dict:
    [last] = sorted((run / "checkpoints").glob("step_*"))[-1:]
    return load_file(last / "policy.safetensors")


def python_kwargs(tmp_path: Path) -> dict:
    """``run_cfg``'s run with its dataset and reward file replaced by Python objects."""
    cfg = tiny_cfg(tmp_path / "api", task="arithmetic", prompt_format="text", eval_split=0.2, steps=2)
    return dict(config=cfg, dataset=datasets.Dataset.from_list(ROWS), reward_funcs=reward_callables(),
                reward_weights=[1, 3], progress=False)


def test_python_objects_give_the_run_the_files_give(tmp_path):
    """The same rows as a ``datasets.Dataset``, the same functions as callables and the weights as
    a list: every logged value and the final weights equal those of the file run (bit for bit)."""
    run_recipe(run_cfg(tmp_path, steps=2, reward_weights="1,3"), progress=False)
    summary = train(**python_kwargs(tmp_path))
    assert summary["steps"] == 2
    assert metrics(tmp_path / "api") == metrics(tmp_path / "run")
    ours, theirs = final_weights(tmp_path / "api"), final_weights(tmp_path / "run")
    assert ours.keys() == theirs.keys() and ours
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    cfg = TrainConfig.from_yaml(tmp_path / "api" / "config.yaml")
    assert (cfg.dataset, cfg.reward_funcs, cfg.reward_weights) == ("python:10 rows", "python:odd_share,level_bonus",
                                                                   "1.0,3.0")


def test_a_resume_takes_the_python_objects_again(tmp_path):
    """The run directory names what came from Python; resuming from the config alone says what to
    pass, and passing it again continues the run to its new end."""
    kwargs = python_kwargs(tmp_path)
    train(**kwargs)
    saved = TrainConfig.from_yaml(tmp_path / "api" / "config.yaml")
    with pytest.raises(ValueError, match=r"dataset: this run's dataset was given as Python objects \(python:10 rows\); "
                                         r"resume it with tether.train.train\(\.\.\., dataset=\.\.\., resume=True\)"):
        build_run(saved)
    with pytest.raises(ValueError, match=r"reward_funcs: this run's reward_funcs was given as Python objects"):
        train(config=saved, dataset=kwargs["dataset"], resume=True, progress=False)
    assert train(**{**kwargs, "config": kwargs["config"].override({"steps": 3})}, resume=True)["steps"] == 3


def test_a_loaded_model_is_saved_beside_the_run_and_trains_like_its_directory(tmp_path):
    """A ``PreTrainedModel`` with its tokenizer is saved to ``<out>.base-model`` and the run reads it
    from there: the same metrics as a run given that directory."""
    tokenizer = byte_tokenizer()
    model = tiny_causal_lm(tokenizer, hidden=64, layers=2, seed=3, head_scale=1.0)
    base = dict(task="arithmetic", steps=1, eval_size=0, checkpoint_every=0)
    train(config=tiny_cfg(tmp_path / "loaded", **base), model=model, tokenizer=tokenizer, progress=False)
    saved = tmp_path / "loaded.base-model"
    assert (saved / "config.json").is_file()
    assert TrainConfig.from_yaml(tmp_path / "loaded" / "config.yaml").model == str(saved)
    train(config=tiny_cfg(tmp_path / "by-path", **base), model=str(saved), progress=False)
    assert metrics(tmp_path / "loaded") == metrics(tmp_path / "by-path")


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(config=3), TypeError, r"config: expected a TrainConfig, a dict of its fields, a YAML path or None, got int"),
    (dict(dataset=[]), TypeError, r"dataset: expected a datasets.Dataset, a non-empty list of dicts .* got list"),
    (dict(eval_dataset=[1, 2]), TypeError, r"eval_dataset: expected a datasets.Dataset"),
    (dict(reward_funcs=[len, 3]), TypeError, r"reward_funcs: expected a callable f\(prompts, completions, \*\*columns\)"),
    (dict(model=object()), TypeError, r"model: expected a model directory or name, or a loaded PreTrainedModel together "
                                      r"with tokenizer=, got object and tokenizer=NoneType"),
    (dict(bogus_field=1), ValueError, r"bogus_field"),
])
def test_bad_arguments_name_themselves(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        train(**{"config": {"out": str(tmp_path / "never")}, **kwargs})
    assert not (tmp_path / "never").exists()
