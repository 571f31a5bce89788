"""Faults end in one line and lose nothing (issue 43): a run killed before its first checkpoint
resumes from step 0, a finished run is checked like an unfinished one, and a dependency's failure
(a tracker's store, PEFT's targets, a full disk, a JSONL line) is one line naming cause and fix."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from tests.train.test_recipe import _metrics, _weights, interrupted_train, tiny_cfg
from tests.train.test_run_dir import assert_same_weights, one_error_line, save_tiny, snapshot
from tether.train.run_dir import RunDirError, read_run_config
from tether.train.cli import main
from tether.train.recipe import train
from tether.train.run_state import RestartNote


def _args(cfg) -> list[str]:
    return [f"{k}={v}" for k, v in cfg.__dict__.items()]


@pytest.fixture(scope="module")
def clean3(tmp_path_factory) -> Path:
    """An uninterrupted 3-step run: what every resumed run below must end as."""
    run = tmp_path_factory.mktemp("clean") / "run"
    train(tiny_cfg(run, steps=3), progress=False)
    return run


# ------------------------------------------------------------------------------ item 1: no checkpoint yet
def test_resume_before_the_first_checkpoint_starts_again_from_step_zero(clean3, tmp_path, capsys):
    """A run that checkpoints only at its end (checkpoint_every=0) dies after logging 2 steps, the
    killed process's last line cut in the middle: no checkpoint, config.yaml and 2.5 lines of
    metrics.jsonl. `--resume` says in one line that it starts again from step 0 (2 logged steps run
    again), exits 0, and ends with the metrics and weights of the clean run: the old lines were
    replaced, not appended to. Before: exit 2, "no checkpoint (no step_* directory) to load"."""
    run = tmp_path / "run"
    interrupted_train(tiny_cfg(run, steps=3, checkpoint_every=0), 2)
    assert not (run / "checkpoints").exists() and len(_metrics(run)) == 2
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 3, "reward_me')
    capsys.readouterr()
    with pytest.warns(RestartNote) as said:  # the CLI prints a tether warning as one line (test_cli_warning_line)
        assert main(["train", "--quiet", "--resume", str(run), "checkpoint_every=1"]) == 0
    assert [str(w.message) for w in said if w.category is RestartNote] == [
        f"resume {run}: the run stopped before its first checkpoint, so nothing was lost; it starts again from "
        "step 0 with its config.yaml; the 2 logged step(s) without a checkpoint are run again."]
    assert "Traceback" not in capsys.readouterr().err
    assert _metrics(run) == _metrics(clean3)
    assert_same_weights(_weights(run), _weights(clean3))


def test_a_restart_keeps_the_saved_config_and_refuses_other_values(tmp_path):
    """Through the Python API: a resume with a config other than config.yaml (another seed) is
    refused naming the key and both values, and nothing is written; with the saved config it warns
    RestartNote and runs all of its steps."""
    run = tmp_path / "run"
    interrupted_train(tiny_cfg(run, steps=2, checkpoint_every=0), 1)
    before = snapshot(run)
    with pytest.raises(RunDirError, match=r"cannot change seed \(0 -> 7\) of its config.yaml"):
        train(tiny_cfg(run, steps=2, checkpoint_every=0, seed=7), resume=True, progress=False)
    assert snapshot(run) == before
    with pytest.warns(RestartNote, match="starts again from step 0"):
        train(read_run_config(run), resume=True, progress=False)
    assert [r["step"] for r in _metrics(run)] == [1, 2] and (run / "summary.json").is_file()


def test_ctrl_c_before_the_first_checkpoint_names_the_resume_that_restarts(tmp_path):
    """The Ctrl-C line of a run with config.yaml and no checkpoint names --resume (which now starts
    it again) instead of --overwrite (which would throw its config away)."""
    from tether.train.interrupt import interruption_line

    run = tmp_path / "run"
    interrupted_train(tiny_cfg(run, steps=2, checkpoint_every=0), 1)
    assert interruption_line(read_run_config(run), copied=False) == (
        f"tether train: interrupted before the first checkpoint of {run}; nothing was lost: tether train --resume "
        f"{run} starts it again from step 0 with its config.yaml.")


# ------------------------------------------------------------------------------ item 2: finished runs
@pytest.fixture(scope="module")
def finished_lora(tmp_path_factory) -> Path:
    """A finished 2-step LoRA run (rank 4 on q_proj, v_proj) of the tiny model."""
    run = tmp_path_factory.mktemp("lora") / "run"
    train(tiny_cfg(run, steps=2, lora_rank=4, lora_alpha=8, lora_targets="q_proj,v_proj"), progress=False)
    return run


def _edit_config(**changes):
    def edit(run: Path) -> None:
        config = yaml.safe_load((run / "config.yaml").read_text())
        (run / "config.yaml").write_text(yaml.safe_dump({**config, **changes}))
    return edit


def _cut_metrics(run: Path) -> None:
    text = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(text[: text.rindex('"step": 2') + 5])


def _bad_completions(run: Path) -> None:
    (run / "completions.jsonl").write_text('{"step": 1}\n{oops\n')


FINISHED_EDITS = {
    "lora_rank": (_edit_config(lora_rank=2), r"step_000002: written with another config than .*lora_rank \(4 -> 2\)"),
    "lora_targets": (_edit_config(lora_targets="q_proj"), r"lora_targets \('q_proj,v_proj' -> 'q_proj'\)"),
    "model": (_edit_config(model="other-model"), r"model \('tiny' -> 'other-model'\)"),
    "cut metrics": (_cut_metrics, r"metrics.jsonl: the lines of steps 1..2 .*missing \[2\]"),
    "bad completions": (_bad_completions, r"completions.jsonl: line 2 is not valid JSON"),
    "bad summary": (lambda run: (run / "summary.json").write_text("{"), r"summary.json: not readable JSON"),
}


@pytest.mark.parametrize("case", sorted(FINISHED_EDITS))
def test_resume_checks_a_finished_run_as_an_unfinished_one(finished_lora, tmp_path, case, capsys):
    """A finished run's config.yaml edited (lora_rank 4 -> 2, other lora_targets, another model) or
    a log damaged (metrics.jsonl cut inside its last line, completions.jsonl or summary.json not
    parsing): `--resume` exits 2 with one line naming the key with both values or the file (and
    line), and changes nothing. Before: "is finished ... nothing to resume", exit 0."""
    run = Path(shutil.copytree(finished_lora, tmp_path / "run"))
    edit, pattern = FINISHED_EDITS[case]
    edit(run)
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", "--quiet", "--resume", str(run)]) == 2
    line = one_error_line(capsys)
    assert line.startswith("tether train: ") and __import__("re").search(pattern, line), line
    assert snapshot(run) == before


def test_a_finished_run_refuses_a_base_replaced_in_place(tmp_path, capsys):
    """A finished LoRA run on model directory A whose weights are then replaced by B's (same shapes,
    another seed): `--resume` names the base and both weight fingerprints, as an unfinished run's
    resume does, exit 2. Before: "is finished", exit 0."""
    a, b = save_tiny(tmp_path / "a", seed=0), save_tiny(tmp_path / "b", seed=1)
    run = tmp_path / "run"
    train(tiny_cfg(run, steps=1, model=str(a), lora_rank=2, lora_targets="q_proj,v_proj"), progress=False)
    recorded = json.loads((run / "checkpoints" / "step_000001" / "state.json").read_text())["base"]
    shutil.copy(b / "model.safetensors", a / "model.safetensors")
    capsys.readouterr()
    assert main(["train", "--quiet", "--resume", str(run)]) == 2
    line = one_error_line(capsys)
    assert f"trained on base model '{a}' (weights {recorded['weights'][:12]}" in line, line
    assert f"now loads weights {recorded['weights'][:12]}" not in line


def test_an_untouched_finished_run_is_still_left_as_it_is(finished_lora, tmp_path, capsys):
    """The checks pass on the run as written: the one 'is finished' line, exit 0."""
    run = Path(shutil.copytree(finished_lora, tmp_path / "run"))
    capsys.readouterr()
    assert main(["train", "--quiet", "--resume", str(run)]) == 0
    assert capsys.readouterr().out.startswith(f"tether train: {run} is finished (step 2 of 2")


# ------------------------------------------------------------------------------ item 3: dependencies
def test_an_mlflow_file_store_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """MLFLOW_TRACKING_URI=file://...: MLflow 3 refuses the store. One line naming the store, MLflow's
    reason and both fixes (sqlite, MLFLOW_ALLOW_FILE_STORE), exit 2, and no run directory left (the
    tracker opens before anything is written). Before: a 51-line traceback and a run directory with
    config.yaml that only --overwrite cleared."""
    pytest.importorskip("mlflow")
    store = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run = tmp_path / "run"
    assert main(["train", "--quiet", *_args(tiny_cfg(run, steps=1, report_to="tensorboard,mlflow"))]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"tether train: report_to: mlflow cannot open a run in {store} (MlflowException: The "
                           "filesystem tracking backend"), line
    assert "MLFLOW_TRACKING_URI=sqlite:///" in line and "MLFLOW_ALLOW_FILE_STORE=true" in line
    assert not run.exists()


def test_lora_targets_the_model_lacks_are_named_with_its_linear_modules(tmp_path, capsys):
    """lora_targets=q_proj,qkv on the tiny Llama-style model: one line naming qkv and the model's
    linear module names (PEFT printed a 29-line traceback when no name matched)."""
    run = tmp_path / "run"
    assert main(["train", "--quiet", *_args(tiny_cfg(run, lora_rank=2, lora_targets="q_proj,qkv"))]) == 2
    assert one_error_line(capsys) == (
        "tether train: lora_targets: qkv names no module of model 'tiny'; its linear modules are down_proj, "
        "gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj. Name some of them, e.g. "
        "lora_targets=down_proj,gate_proj, or train every weight with lora_rank=0.")
    assert not run.exists()


def test_a_disk_that_fills_during_a_checkpoint_loses_nothing(clean3, tmp_path, monkeypatch, capsys):
    """The disk fills while step 2's optimizer file is written (fault injection: the write raises
    ENOSPC after writing part of the file). One line: the checkpoint's path, the bytes it needs,
    step 1's checkpoint intact, the resume command; exit 2; no partial directory left. After space
    is back, that command ends as the clean run. Before: a traceback through the test's writer."""
    import tether.train.checkpoint as checkpoint

    real, calls = checkpoint.save_file, []

    def filling(tensors, path):
        calls.append(path)
        if "step_000002" in path and path.endswith("optimizer.safetensors"):
            Path(path).write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(tensors, path)

    monkeypatch.setattr(checkpoint, "save_file", filling)
    run = tmp_path / "run"
    assert main(["train", "--quiet", *_args(tiny_cfg(run, steps=3))]) == 2
    line = one_error_line(capsys)
    # step 2's tensors have step 1's shapes: the bytes its tensors need, without the files' headers
    needed = sum(t.numel() * t.element_size() for p in (run / "checkpoints" / "step_000001").glob("*.safetensors")
                 for t in load_file(str(p)).values())
    assert line.startswith(f"tether train: {run / 'checkpoints' / 'step_000002'}: the disk filled while this "
                           "checkpoint was written (it needs about "), line
    assert f"the newest checkpoint, {run / 'checkpoints' / 'step_000001'}, is intact" in line
    assert line.endswith(f"then continue with: tether train --resume {run}")
    assert f"it needs about {needed} bytes; " in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001"]
    monkeypatch.setattr(checkpoint, "save_file", real)
    assert main(["train", "--quiet", "--resume", str(run)]) == 0
    assert _metrics(run) == _metrics(clean3)
    assert_same_weights(_weights(run), _weights(clean3))


def test_another_write_error_keeps_its_traceback(tmp_path, monkeypatch, capsys):
    """Only a full disk is turned into the checkpoint line: an EIO from the writer (here the test's,
    standing for a dependency) keeps the CLI's line with where it was raised and its traceback."""
    import tether.train.checkpoint as checkpoint

    def failing(tensors, path):
        raise OSError(errno.EIO, "Input/output error", path)

    monkeypatch.setattr(checkpoint, "save_file", failing)
    assert main(["train", "--quiet", *_args(tiny_cfg(tmp_path / "run", steps=1))]) == 2
    err = capsys.readouterr().err
    assert "Input/output error" in err and "Traceback" in err and "the disk filled" not in err
    assert f"was raised in {Path(__file__).resolve()}" in err


def test_a_jsonl_dataset_line_that_does_not_parse_is_named(tmp_path, capsys):
    """--dataset rows.jsonl whose line 2 misses a comma: one line with the file and line 2
    (datasets reported a byte position in the whole file, no line)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2" "answer": "4"}\n')
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def zero(prompts, completions, **kw):\n    return [0.0 for _ in completions]\n")
    run = tmp_path / "run"
    args = _args(tiny_cfg(run, task="arithmetic", dataset=str(rows), reward_funcs=str(rewards)))
    assert main(["train", "--quiet", *args]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"tether train: dataset: cannot read {rows} as .jsonl (line 2 is not valid JSON: "
                           "Expecting ','"), line
    assert not run.exists()


# ------------------------------------------------------------------------------ item 6: held-out results
def test_held_out_results_reach_tensorboard_and_mlflow(tmp_path, monkeypatch):
    """A 2-step run with eval_every=1 reporting to TensorBoard and MLflow (sqlite in the run): both
    stores hold eval_accuracy at steps 0 (before), 1, 2 (periodic) and 2 (after), eval_reward beside
    it, and eval_kl_per_seq / eval_kl_per_token at step 2 equal to summary.json's, read back from
    the real event files and the real MLflow database. Before: only eval_accuracy at steps 1, 2."""
    pytest.importorskip("mlflow")
    from tests.train.test_tracking import _events, _mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "run"
    summary = train(tiny_cfg(run, steps=2, eval_every=1, report_to="tensorboard,mlflow"), progress=False)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    periodic = [(r["step"], r["eval_accuracy"]) for r in records]
    want = {"eval_accuracy": [(0, summary["accuracy_before"]), *periodic, (2, summary["accuracy_after"])],
            "eval_reward": [(0, summary["reward_before"]), *[(r["step"], r["eval_reward"]) for r in records],
                            (2, summary["reward_after"])],
            "eval_kl_per_seq": [(2, summary["eval_kl_per_seq"])],
            "eval_kl_per_token": [(2, summary["eval_kl_per_token"])]}
    events = _events(run)
    mlflow, client = _mlflow(run)
    (run_id,) = mlflow.search_runs(experiment_names=["tether"])["run_id"]
    for key, points in want.items():
        logged = events.Scalars(key)  # float32 in the event file
        assert [e.step for e in logged] == [step for step, _ in points], key
        assert [e.value for e in logged] == pytest.approx([value for _, value in points], rel=1e-6), key
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, key)] == points, key
