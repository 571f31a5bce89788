"""The trackers ``report_to`` names beside ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

Each gets every numeric value of each step's record under the record's own key, with the step as
its x-axis, and the logged completions as a table. TensorBoard writes ``RUN/tensorboard/``; wandb
``RUN/wandb/`` (``WANDB_MODE=offline`` needs no network); MLflow ``MLFLOW_TRACKING_URI`` or else a
SQLite store ``RUN/mlflow.db``. Each library is imported when its tracker opens, and a missing one
is named with its extra. A resume cuts TensorBoard back to the checkpoint's step (``purge_step``);
wandb and MLflow continue the same run (its id is kept in the run directory) and, having no way
to delete points, hold the recomputed steps twice.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from tether.ops.checks import lookup

TENSORBOARD_DIR = "tensorboard"
COMPLETION_COLUMNS = ("prompt", "completion", "reward")


class NullTracker:
    """``report_to: none``: nothing beyond ``metrics.jsonl`` and ``completions.jsonl``."""

    def __init__(self, run_dir: Path, *, resume_step: int | None = None, config: dict | None = None) -> None:
        pass

    def scalars(self, record: dict[str, Any]) -> None:
        pass

    def completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """Event files in ``RUN/tensorboard/`` through ``torch.utils.tensorboard`` (needs ``tensorboard``)."""

    def __init__(self, run_dir: Path, *, resume_step: int | None = None, config: dict | None = None) -> None:
        SummaryWriter = _need("tensorboard", "torch.utils.tensorboard", "tensorboard").SummaryWriter
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


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


def _run_id(path: Path, new: Callable[[], str]) -> str:
    """The tracker run id kept in ``path`` (a resume continues that run), or a new one."""
    if not path.is_file():
        path.write_text(new())
    return path.read_text().strip()


class WandbTracker:
    """A Weights & Biases run in ``RUN/wandb/`` (project ``WANDB_PROJECT`` or ``tether``), its id in
    ``RUN/wandb_run_id``; the run's config is the wandb config."""

    def __init__(self, run_dir: Path, *, resume_step: int | None = None, config: dict | None = None) -> None:
        wandb = _need("wandb", "wandb", "wandb")
        run_id = _run_id(run_dir / "wandb_run_id", lambda: uuid.uuid4().hex[:12])
        try:
            self.run = wandb.init(dir=str(run_dir), project=os.environ.get("WANDB_PROJECT", "tether"),
                                  name=run_dir.name, id=run_id, resume="allow", config=config,
                                  settings=wandb.Settings(console="off"))
        except Exception as exc:  # wandb raises its own types (no API key, no network)
            raise TrackerError(f"report_to: wandb could not start a run ({exc}); log in with `wandb login`, "
                               "or set WANDB_MODE=offline to write it to RUN/wandb/ and `wandb sync` it later.") from exc
        self.wandb = wandb
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def scalars(self, record: dict[str, Any]) -> None:
        self.run.log({"step": record["step"], **_numbers(record)})

    def completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self.wandb.Table(columns=list(COMPLETION_COLUMNS), data=[[r[c] for c in COMPLETION_COLUMNS] for r in rows])
        self.run.log({"step": step, "completions": table})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run (experiment ``MLFLOW_EXPERIMENT_NAME`` or ``tether``) in ``MLFLOW_TRACKING_URI``,
    or else in ``RUN/mlflow.db`` with artifacts in ``RUN/mlartifacts/``; its id in ``RUN/mlflow_run_id``.
    The run's config goes in as parameters, completions as ``completions/step_NNNNNN.json`` tables."""

    def __init__(self, run_dir: Path, *, resume_step: int | None = None, config: dict | None = None) -> None:
        MlflowClient = _need("mlflow", "mlflow", "mlflow").MlflowClient
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException

        self.metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        store = uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        artifacts = None if uri else (run_dir / "mlartifacts").resolve().as_uri()
        try:
            self.client = MlflowClient(tracking_uri=store)
            self._open(run_dir, config, artifacts, Param)
        except (MlflowException, OSError) as exc:  # the store cannot be used (refused, unreachable, unwritable)
            raise TrackerError(_mlflow_problem(store, exc)) from exc

    def _open(self, run_dir: Path, config: dict | None, artifacts: str | None, Param: Any) -> None:
        def new_run() -> str:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "tether")
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name, artifact_location=artifacts)
            run_id = self.client.create_run(experiment, run_name=run_dir.name).info.run_id
            self.client.log_batch(run_id, params=[Param(k, str(v)) for k, v in (config or {}).items()])
            return run_id

        self.run_id = _run_id(run_dir / "mlflow_run_id", new_run)
        self.client.update_run(self.run_id, status="RUNNING")

    def scalars(self, record: dict[str, Any]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.metric(key, value, now, record["step"]) for key, value in _numbers(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = {c: [r[c] for r in rows] for c in COMPLETION_COLUMNS}
        self.client.log_table(self.run_id, data=table, artifact_file=f"completions/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackerError(ValueError):
    """A tracker that ``report_to`` names cannot start: the store, login or package it needs is missing."""


def _mlflow_problem(store: str, exc: BaseException) -> str:
    """One line for an MLflow store that cannot be used: the store, MLflow's first sentence, the fix."""
    said = " ".join(str(exc).split()).split(". ")[0].rstrip(".")
    if store.startswith("file:") or "://" not in store:  # a plain path is a file store as well
        fix = ("MLflow 3 refuses file stores: set MLFLOW_TRACKING_URI=sqlite:///PATH/mlflow.db, or unset it "
               "(tether then writes RUN/mlflow.db), or set MLFLOW_ALLOW_FILE_STORE=true to keep the file store")
    else:
        fix = ("check that MLFLOW_TRACKING_URI names a store MLflow can open, or unset it (tether then writes "
               "RUN/mlflow.db)")
    return f"report_to: mlflow cannot open a run in {store} ({type(exc).__name__}: {said}); {fix}."


class Trackers:
    """Several trackers as one: each call goes to each, in ``report_to``'s order."""

    def __init__(self, trackers: list[Any]) -> None:
        self.trackers = trackers

    def scalars(self, record: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.scalars(record)

    def completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        for tracker in self.trackers:
            tracker.completions(step, rows)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


TRACKERS: dict[str, Callable[..., Any]] = {"none": NullTracker, "tensorboard": TensorBoardTracker,
                                          "wandb": WandbTracker, "mlflow": MlflowTracker}


def tracker_names(report_to: str) -> list[str]:
    """The tracker names of a ``report_to`` value: comma-separated, ``none`` meaning no tracker."""
    return [name.strip() for name in report_to.split(",") if name.strip() not in ("", "none")]


def make_tracker(report_to: str, run_dir: Path, *, resume_step: int | None = None, config: dict | None = None) -> Any:
    """The trackers ``report_to`` names (``TRACKERS``), opened on ``run_dir`` (created if needed).
    When one cannot start, those opened are closed and whatever they wrote is removed, the
    directory too if it was created here, and the error is raised: the run directory is as before."""
    kinds = [lookup(TRACKERS, name, "report_to") for name in tracker_names(report_to)]
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    there = set(run_dir.iterdir())
    opened: list[Any] = []
    try:
        for kind in kinds:
            opened.append(kind(run_dir, resume_step=resume_step, config=config))
    except BaseException:
        for tracker in opened:
            tracker.close()
        for path in set(run_dir.iterdir()) - there:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        if created:
            run_dir.rmdir()
        raise
    return Trackers(opened)


def _need(extra: str, module: str, package: str) -> Any:
    """Import ``module`` for ``report_to: extra``, or say which package to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackerError(f"report_to: {extra!r} needs the {package} package, which is not installed; "
                          f"pip install 'tether[{extra}]' (or {package}), or leave {extra} out of report_to.") from exc


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def completions_markdown(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the rows (TensorBoard renders text summaries as Markdown)."""
    lines = ["| prompt | completion | reward |", "|---|---|---|"]
    lines += [f"| {_cell(r['prompt'])} | {_cell(r['completion'])} | {r['reward']:.4g} |" for r in rows]
    return "\n".join(lines)
