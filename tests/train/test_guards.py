"""What ``tether train``/``eval`` refuse: non-finite config values and updates, task code named by a
run directory, broken YAML, tasks returning the wrong type (issue 14, items 7 and 9)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.train.test_recipe import tiny_cfg
from tests.train.test_run_dir import one_error_line, steps_kept
from tether.train import recipe
from tether.train.cli import main
from tether.train.config import TrainConfig
from tether.train.metrics import MetricsLog
from tether.train.recipe import build_run, train
from tether.train.updates import NonFiniteUpdateError
from tether.train.tasks import TaskError


# ------------------------------------------------------------------------------ item 7
@pytest.mark.parametrize("name", ["learning_rate", "kl_coef", "temperature", "weight_decay", "grad_clip",
                                  "lora_alpha", "entropy_coeff", "kl_target", "clip_epsilon_high"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_config_values_are_refused_by_name(tmp_path, name, value):
    with pytest.raises(ValueError, match=rf"{name}: expected a finite number( [>=]+ 0)?, got {value}\."):
        tiny_cfg(tmp_path, **{name: value}).validate()


def test_cli_refuses_infinite_learning_rate_before_writing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--quiet", "--model", "tiny", "--out", str(out), "learning_rate=inf"]) == 2
    assert "learning_rate: expected a finite number > 0, got inf." in one_error_line(capsys)
    assert not out.exists()


def poisoned_rollout(bad_step: int):
    """The recipe's rollout (its public ``rollout=`` seam) with NaN sampling log-probs at step
    ``bad_step`` (0-based): the importance ratio, the loss and every gradient of that update are NaN."""

    def rollout(run, problems, step):
        record = recipe.sample(run, problems, step)
        if step == bad_step:
            record.sample_log_probs = record.sample_log_probs.masked_fill(record.assistant_mask, math.nan)
        return record
    return rollout


def test_a_non_finite_update_stops_before_the_step_log_and_checkpoint(tmp_path):
    """NaN gradients at step 2 of 3 (checkpoint every step): the error names step 2 and the
    checkpoint that is left; metrics and checkpoints hold step 1 only, with finite weights."""
    run = tmp_path / "run"
    with pytest.raises(NonFiniteUpdateError, match=r"step 2: loss .* gradient norm nan.*holds the checkpoints of steps 1;"):
        train(tiny_cfg(run), progress=False, rollout=poisoned_rollout(1))
    assert [r["step"] for r in MetricsLog(run / "metrics.jsonl").read()] == [1]
    assert steps_kept(run) == ["step_000001"]


def test_a_non_finite_gradient_leaves_the_weights_and_optimizer_untouched(tmp_path):
    """A step with NaN gradients raises before ``optimizer.step``: every parameter equals its
    value before, and AdamW has no state (no step was counted)."""
    run = build_run(tiny_cfg(tmp_path / "run"))
    before = {n: p.detach().clone() for n, p in run.models.policy.named_parameters()}
    with pytest.raises(NonFiniteUpdateError, match="step 1: "):
        recipe.train_step(run, 0, poisoned_rollout(0))
    assert all(torch.equal(p, before[n]) for n, p in run.models.policy.named_parameters())
    assert not run.optimizer.state


# ------------------------------------------------------------------------------ item 9
MARKER_TASK = '''
from pathlib import Path
Path(__file__).with_suffix(".ran").write_text("executed")
from tests.train.count_task import TASK
'''


def test_eval_runs_no_task_code_from_a_run_directory_without_the_flag(tmp_path, capsys):
    """A run whose task is a .py file that leaves a marker when imported: `tether eval RUN`
    exits 2 naming that file and the flag, and the file did not run; with
    --trust-task-code it runs and the evaluation is printed."""
    task = tmp_path / "marker_task.py"
    task.write_text(MARKER_TASK)
    run = tmp_path / "run"
    train(tiny_cfg(run, steps=1, task=str(task)), progress=False)
    marker = task.with_suffix(".ran")
    marker.unlink()
    capsys.readouterr()
    assert main(["eval", str(run)]) == 2
    line = one_error_line(capsys)
    assert str(task) in line and "--trust-task-code" in line
    assert not marker.exists()
    assert main(["eval", str(run), "--trust-task-code"]) == 0
    assert marker.read_text() == "executed"
    assert json.loads(capsys.readouterr().out)["n"] == 4


def test_eval_of_a_registered_task_needs_no_flag(tmp_path, capsys):
    """The default task is tether's own code: no flag needed."""
    run = tmp_path / "run"
    train(tiny_cfg(run, steps=1, task="arithmetic"), progress=False)
    capsys.readouterr()
    assert main(["eval", str(run), "--eval-size", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 2


# ------------------------------------------------------------------------------ vague errors
def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\nseed: [1, 2\n")
    with pytest.raises(ValueError, match=rf"{bad}: not valid YAML .* line 3, column 1"):
        TrainConfig.from_yaml(bad)
    assert main(["train", "--config", str(bad)]) == 2
    line = one_error_line(capsys)
    assert str(bad) in line and "<unicode string>" not in line


BAD_TASKS = {
    "make_problem": "make_problem=lambda rng: {'chat': [], 'answer': '1', 'key': str(rng.random())}, "
                    "reward=lambda r, p: 1.0, is_correct=lambda r, p: True",
    "reward": "make_problem=TASK.make_problem, reward=lambda r, p: {'score': 1.0}, is_correct=TASK.is_correct",
    "is_correct": "make_problem=TASK.make_problem, reward=TASK.reward, is_correct=lambda r, p: {'ok': True}",
}


@pytest.mark.parametrize("fn", sorted(BAD_TASKS))
def test_a_task_returning_a_dict_names_the_task_function(tmp_path, fn, capsys):
    """Each callable of a task returning a dict raises TaskError (a TypeError) naming the task,
    the callable and its file, through the API and the CLI (exit 2)."""
    path = tmp_path / "dict_task.py"
    path.write_text(f"from tests.train.count_task import TASK\nfrom tether.train.tasks import Task\n"
                    f"TASK = Task(name='dicts', {BAD_TASKS[fn]})\n")
    with pytest.raises(TaskError, match=rf"task 'dicts': {fn} \(<lambda> in {path}\) returned dict"):
        train(tiny_cfg(tmp_path / "run", task=str(path)), progress=False)
    args = [f"{k}={v}" for k, v in tiny_cfg(tmp_path / "cli", task=str(path)).__dict__.items()]
    assert main(["train", "--quiet", *args]) == 2
    assert f"{fn} (<lambda> in {path}) returned dict" in one_error_line(capsys)


def test_metrics_log_skips_an_unfinished_last_line_and_names_a_bad_one(tmp_path):
    """A kill can cut the last write short: that line is left out. A bad line before it is an
    error naming the file and the line number."""
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.path.write_text('{"step": 1, "x": 1.5}\n{"step": 2, "x"')
    assert log.read() == [{"step": 1, "x": 1.5}]
    log.path.write_text('{"step": 1}\n[1, 2]\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"{log.path}: line 2 is not a step record"):
        log.read()



def test_plot_names_a_missing_directory_a_file_and_a_directory_without_metrics(tmp_path, capsys):
    """`tether plot` on a path that does not exist says so (not "no metrics"), as it does for a
    file and for a directory that holds no metrics.jsonl; an empty metrics.jsonl keeps its message."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "metrics.jsonl").write_text("")
    for name, fragment in (("nope", "nope: does not exist; expected a run directory"),
                           ("file", "file: is a file; expected a run directory"),
                           ("empty", "empty: holds no metrics.jsonl, so it is not a tether run directory"),
                           ("fresh", "fresh/metrics.jsonl: no metrics to plot")):
        assert main(["plot", str(tmp_path / name)]) == 2
        line = one_error_line(capsys)
        assert line.startswith(f"tether plot: {tmp_path / name}") and fragment in line, line
        assert name == "fresh" or "no metrics to plot" not in line
    assert not (tmp_path / "nope").exists()
