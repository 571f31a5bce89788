"""Tracking: TensorBoard holds the scalars of metrics.jsonl, completions are logged every K steps,
a resume cuts both back to its checkpoint, and the plots leave out constant panels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train.test_recipe import interrupted_train, tiny_cfg
from tether.train.config import TrainConfig
from tether.integrations.trackers import completions_markdown
from tether.train.metrics import COMPLETIONS_FILE
from tether.train.plots import PLOTTED, constant_panels, plotted_panels
from tether.train.recipe import train


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
    the value rounded to float32 (TensorBoard's storage), and nothing else is there but the
    held-out results before training (step 0) and after it (the last step; test_faults)."""
    records = _lines(tracked / "metrics.jsonl")
    acc = _events(tracked)
    numeric = {k for r in records for k, v in r.items() if k != "step" and isinstance(v, (int, float))
               and not isinstance(v, bool)}
    held_out = {"eval_accuracy", "eval_reward", "eval_response_length", "eval_kl_per_seq", "eval_kl_per_token"}
    assert set(acc.Tags()["scalars"]) == numeric | held_out and {"eval_accuracy", "lr", "grad_norm"} <= numeric
    for key in numeric:
        logged = [(r["step"], r[key]) for r in records if key in r]
        events = [(e.step, e.value) for e in acc.Scalars(key)]
        events = events[1:-1] if key in held_out else events  # less before (step 0) and after (step 4)
        events = events[:-1] if key == "eval_kl_sampled_per_seq" else events  # no "before": the policy is the reference
        assert [step for step, _ in events] == [step for step, _ in logged], key
        for (step, got), (_, value) in zip(events, logged):
            assert got == pytest.approx(value, rel=1e-6, abs=1e-30), (key, step)


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
    run) nothing is left out, and the budget's scale and forwards and the sampler-learner KL get
    panels of their own."""
    assert constant_panels({}) == {"clip_fraction", "ess", "lr"}
    assert constant_panels({"kl_controller": "constant"}) == {"clip_fraction", "ess", "kl_coef", "lr"}
    assert constant_panels({"updates_per_rollout": 2, "kl_controller": "target", "warmup_steps": 1}) == set()
    drawn = {k for k, _, _ in plotted_panels(json.loads(json.dumps(TrainConfig().__dict__)))}
    assert drawn == {k for k, _, _ in PLOTTED} - {"clip_fraction", "ess", "lr"} and "kl_coef" in drawn
    plots = {p.stem for p in (tracked / "plots").glob("*.png")}
    assert plots == {k for k, _, _ in PLOTTED} | {"kl_move_scale", "kl_move_forwards", "kl_behaviour_per_token", "overview"}


# ------------------------------------------------------------------ wandb and MLflow, read back
def _wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then
    LevelDB-log chunks (crc32 4, length 2, type 1: full 1, first 2, middle 3, last 4) in 32 KiB
    blocks whose tails under 7 bytes are padding."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if room >= 7 else (0, 0, 0)
        if kind == 0:
            pos += room
            continue
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_history(run: Path) -> list[dict]:
    """Every ``log`` call of every wandb process of the run, in order (offline runs, one per process)."""
    rows = []
    for path in sorted(run.glob("wandb/offline-run-*/run-*.wandb")):
        rows += [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                 for r in _wandb_records(path) if r.WhichOneof("record_type") == "history"]
    return rows


def _mlflow(run: Path):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    mlflow.set_tracking_uri(client.tracking_uri)
    return mlflow, client


@pytest.fixture(scope="module")
def wandb_mlflow(tmp_path_factory) -> Path:
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    run = tmp_path_factory.mktemp("trackers") / "run"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        train(tiny_cfg(run, steps=3, report_to="wandb,mlflow", log_completions_every=3), progress=False)
    return run


def test_wandb_history_equals_the_jsonl(wandb_mlflow):
    """Each step's numeric values reach wandb unrounded (JSON doubles) with ``step`` as the x-axis;
    step 3's completions are a 3-column table of the same rows as completions.jsonl."""
    records = _lines(wandb_mlflow / "metrics.jsonl")
    history = _wandb_history(wandb_mlflow)
    held_out = [h for h in history if all(k.startswith(("eval_", "_")) or k == "step" for k in h)]
    assert [h["step"] for h in held_out] == [0, 3]  # before and after training (test_faults)
    scalars = [h for h in history if "completions/_type" not in h and h not in held_out]
    for record, logged in zip(records, scalars, strict=True):
        expected = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        assert {k: v for k, v in logged.items() if not k.startswith("_")} == expected
    (table,) = [h for h in history if "completions/_type" in h]
    assert (table["step"], table["completions/_type"], table["completions/ncols"]) == (3, "table-file", 3)
    stored = json.loads(next(wandb_mlflow.glob("wandb/offline-run-*/files/" + table["completions/path"])).read_text())
    rows = [r for r in _lines(wandb_mlflow / COMPLETIONS_FILE) if r["step"] == 3]
    assert stored["columns"] == ["prompt", "completion", "reward"]
    assert stored["data"] == [[r["prompt"], r["completion"], r["reward"]] for r in rows]


def test_mlflow_run_holds_the_jsonl_and_the_config(wandb_mlflow):
    """``mlflow.search_runs`` finds one finished run named after the run directory, its params are
    the config, and each metric's history is metrics.jsonl's values (float64, exact) at their steps."""
    mlflow, client = _mlflow(wandb_mlflow)
    runs = mlflow.search_runs(experiment_names=["tether"])
    assert len(runs) == 1 and runs["tags.mlflow.runName"][0] == "run" and runs["status"][0] == "FINISHED"
    run_id = runs["run_id"][0]
    assert (wandb_mlflow / "mlflow_run_id").read_text() == run_id
    params = client.get_run(run_id).data.params
    assert params["learning_rate"] == "0.001" and params["report_to"] == "wandb,mlflow"
    records = _lines(wandb_mlflow / "metrics.jsonl")
    for key in ("reward_mean", "loss", "kl_coef"):
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, key)] == [
            (r["step"], r[key]) for r in records]
    table = json.loads(Path(client.download_artifacts(run_id, "completions/step_000003.json")).read_text())
    assert table["columns"] == ["prompt", "completion", "reward"] and len(table["data"]) == 6


def test_resume_continues_the_same_wandb_and_mlflow_runs(tmp_path, monkeypatch):
    """Cut after step 3 (checkpoint at 2) and resumed to 4: one MLflow run whose history holds
    step 3 twice (MLflow cannot delete points; the last value is the resumed run's), and a second
    wandb process under the same run id."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "run"
    interrupted_train(tiny_cfg(run, steps=4, report_to="wandb,mlflow", checkpoint_every=2), 3)
    train(TrainConfig.from_yaml(run / "config.yaml"), resume=True, progress=False)
    mlflow, client = _mlflow(run)
    (run_id,) = mlflow.search_runs(experiment_names=["tether"])["run_id"]
    history = client.get_metric_history(run_id, "reward_mean")
    assert [m.step for m in history] == [1, 2, 3, 3, 4]
    final = {r["step"]: r["reward_mean"] for r in _lines(run / "metrics.jsonl")}
    assert history[-2].value == final[3] and history[-1].value == final[4]
    ids = {p.name.rsplit("-", 1)[1] for p in run.glob("wandb/offline-run-*")}
    assert ids == {(run / "wandb_run_id").read_text()} and len(list(run.glob("wandb/offline-run-*"))) == 2
    # step 0 and the second 4: the held-out results before and after training (test_faults)
    assert [h["step"] for h in _wandb_history(run)] == [0, 1, 2, 3, 3, 4, 4]


def test_report_to_repeated_on_the_command_line(tmp_path):
    """``--report-to`` repeated joins its values, as the comma-separated key does."""
    from tether.train.cli import main

    seen = {}
    code = main(["train", "--model", "tiny", "--report-to", "tensorboard", "--report-to", "wandb,mlflow",
                 "--out", str(tmp_path / "r"), "--quiet"], train_fn=lambda cfg, **_: seen.update(cfg=cfg) or {})
    assert code == 0 and seen["cfg"].report_to == "tensorboard,wandb,mlflow"
