"""Tracking: TensorBoard holds the scalars of metrics.jsonl, completions are logged every K steps,
a resume cuts both back to its checkpoint, and the plots leave out constant panels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train.test_recipe import interrupted_train, tiny_cfg
from tether.train.config import TrainConfig
from tether.train.metrics import PLOTTED, constant_panels, plotted_panels
from tether.train.recipe import train
from tether.train.tracking import COMPLETIONS_FILE, completions_markdown


def _events(run: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("tracked") / "run"
    train(tiny_cfg(run, steps=4, report_to="tensorboard", log_completions_every=2, updates_per_rollout=2,
                   lr_schedule="linear", eval_every=2), progress=False)
    return run


def test_tensorboard_scalars_equal_the_jsonl(tracked):
    """Every numeric key of every metrics.jsonl line is a TensorBoard scalar at that step, with
    the value rounded to float32 (TensorBoard's storage), and nothing else is there."""
    records = _lines(tracked / "metrics.jsonl")
    acc = _events(tracked)
    numeric = {k for r in records for k, v in r.items() if k != "step" and isinstance(v, (int, float))
               and not isinstance(v, bool)}
    assert set(acc.Tags()["scalars"]) == numeric and {"eval_accuracy", "lr", "grad_norm"} <= numeric
    for key in numeric:
        logged = {r["step"]: r[key] for r in records if key in r}
        events = {e.step: e.value for e in acc.Scalars(key)}
        assert events.keys() == logged.keys(), key
        for step, value in logged.items():
            assert events[step] == pytest.approx(value, rel=1e-6, abs=1e-30), (key, step)


def test_completions_every_k_steps(tracked):
    """Steps 2 and 4 of 4 log all 6 samples (fewer than COMPLETION_ROWS): their rewards average
    to the step's logged reward_mean, and TensorBoard has the same rows as a text table."""
    rows = _lines(tracked / COMPLETIONS_FILE)
    assert [r["step"] for r in rows] == [2] * 6 + [4] * 6
    assert set(rows[0]) == {"step", "prompt", "completion", "reward", "correct"}
    records = {r["step"]: r for r in _lines(tracked / "metrics.jsonl")}
    for step in (2, 4):
        rewards = [r["reward"] for r in rows if r["step"] == step]
        assert sum(rewards) / 6 == pytest.approx(records[step]["reward_mean"], rel=1e-6)
    texts = _events(tracked).Tensors("completions/text_summary")
    assert [t.step for t in texts] == [2, 4]
    table = texts[0].tensor_proto.string_val[0].decode()
    assert table == completions_markdown([r for r in rows if r["step"] == 2])


def test_resume_cuts_tensorboard_and_completions_back(tmp_path):
    """Cut after step 3 (checkpoint at 2), resumed to 4: step 3 appears once in the event files
    and in completions.jsonl, as in metrics.jsonl."""
    run = tmp_path / "run"
    kw = dict(steps=4, report_to="tensorboard", log_completions_every=1, checkpoint_every=2)
    interrupted_train(tiny_cfg(run, **kw), 3)
    train(TrainConfig.from_yaml(run / "config.yaml"), resume=True, progress=False)
    assert [e.step for e in _events(run).Scalars("reward_mean")] == [1, 2, 3, 4]
    assert [r["step"] for r in _lines(run / COMPLETIONS_FILE)] == [s for s in (1, 2, 3, 4) for _ in range(6)]


def test_plots_drop_constant_panels_and_mark_held_out_accuracy(tracked, tmp_path):
    """One update per rollout: clip fraction and ESS are constant (ratio 1), as are beta under a
    constant controller and the LR of a constant schedule; the default (budget) controller
    moves beta. With two updates, a linear schedule and the default controller (the tracked
    run) nothing is left out, and the budget's scale and forwards get panels of their own."""
    assert constant_panels({}) == {"clip_fraction", "ess", "lr"}
    assert constant_panels({"kl_controller": "constant"}) == {"clip_fraction", "ess", "kl_coef", "lr"}
    assert constant_panels({"updates_per_rollout": 2, "kl_controller": "target", "warmup_steps": 1}) == set()
    drawn = {k for k, _, _ in plotted_panels(json.loads(json.dumps(TrainConfig().__dict__)))}
    assert drawn == {k for k, _, _ in PLOTTED} - {"clip_fraction", "ess", "lr"} and "kl_coef" in drawn
    plots = {p.stem for p in (tracked / "plots").glob("*.png")}
    assert plots == {k for k, _, _ in PLOTTED} | {"kl_move_scale", "kl_move_forwards", "overview"}
