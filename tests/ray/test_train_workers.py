"""``train`` with Ray workers on a cluster the caller started: a step that raises still frees the
workers and the service (they would otherwise hold the cluster's CPUs), and the config checks.

Its own module: the pool of test_workers.py holds the session cluster's CPUs until that
module ends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from tests.ray.test_workers import COUNT_TASK, tiny_cfg, wait_for_free_cpus
from tether.train import recipe_ray
from tether.train.metrics import MetricsLog
from tether.train.rewards import RewardError
from tether.train.tasks import load_task

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]


def failing_task(path: Path, cfg, step: int) -> str:
    """A copy of the odd-share task whose reward raises on the problems of ``step`` (1-based)."""
    task = load_task(cfg.task)
    first = (step - 1) * cfg.prompts_per_step
    keys = [task.train_problem(cfg.seed, first + i, set()).key for i in range(cfg.prompts_per_step)]
    source = Path(COUNT_TASK).read_text().replace(
        "def _reward(response, problem):\n",
        f"def _reward(response, problem):\n    if problem.key in {keys!r}:\n"
        "        raise ValueError('broken on purpose')\n")
    path.write_text(source)
    return str(path)


def test_train_that_raises_mid_run_releases_the_workers(tmp_path):
    """``train`` with workers=2 (full fine-tuning) on a task whose reward raises on the second
    step's problems: the error reaches the caller, step 1's record was written (its KL from the
    service's reference log-probs is 0: at step 1 the policy is the reference), and train's
    clean-up stopped the workers and the service, so the cluster's 2 CPUs are free again. The
    raised error's traceback holds train's frame and with it the pool, so the CPUs come back
    through the clean-up, not through the actor handles being dropped."""
    cfg = tiny_cfg(tmp_path / "ray")
    cfg = tiny_cfg(tmp_path / "ray", task=failing_task(tmp_path / "failing_task.py", cfg, step=2))
    with pytest.raises(RewardError, match=r"reward raised ValueError: broken on purpose at step 2,") as raised, \
            pytest.warns(UserWarning, match="sampled KL"):
        recipe_ray.train(cfg, progress=False)
    [record] = MetricsLog(tmp_path / "ray" / "metrics.jsonl").read()
    assert record["step"] == 1 and record["kl_per_seq"] == pytest.approx(0.0, abs=1e-5)
    assert ray.is_initialized()  # the session's cluster, not train's: left connected
    assert wait_for_free_cpus(2.0) == 2.0
    assert raised.traceback  # held until here


def test_kl_budget_reads_k1_against_the_services_log_probs(tmp_path):
    """workers=2 with kl_controller=budget: the ReferenceService returns log-probs only, so the
    budget reads k1 of the updated weights against them (``kl_signal`` sampled); with a target of
    0.01 nats it moves the weights, and every move it keeps reads under the band's top."""
    cfg = tiny_cfg(tmp_path / "ray", steps=3, learning_rate=1e-2, kl_controller="budget", kl_target=0.01)
    with pytest.warns(UserWarning, match="sampled KL"):
        recipe_ray.train(cfg, progress=False)
    records = MetricsLog(tmp_path / "ray" / "metrics.jsonl").read()
    assert all(r["kl_signal"] == "sampled" for r in records)
    moved = [r for r in records if r["kl_move_scale"] != 1.0]
    assert moved and all(r["kl_kept_per_seq"] <= 0.0125 for r in moved if not r["step_rejected"])
    assert wait_for_free_cpus(2.0) == 2.0


def test_config_accepts_workers_and_refuses_negative_counts(tmp_path):
    assert tiny_cfg(tmp_path, workers=3).validate().workers == 3
    with pytest.raises(ValueError, match="workers: expected an int >= 0, got -1"):
        tiny_cfg(tmp_path, workers=-1).validate()
    assert tiny_cfg(tmp_path, ray_timeout=0.5).validate().ray_timeout == 0.5
    for bad in (0.0, float("inf")):
        with pytest.raises(ValueError, match=rf"ray_timeout: expected a finite number > 0, got {bad}\. It is in seconds"):
            tiny_cfg(tmp_path, ray_timeout=bad).validate()


def test_a_worker_killed_mid_run_stops_with_one_line_naming_the_checkpoint(tmp_path, monkeypatch, capsys):
    """`tether train --workers 2`, a checkpoint every step; just as step 2's rollout starts, worker 0
    is killed (fault injection: ray.kill before the pool sends it rows; it has max_restarts=0). The
    CLI exits 2 with one line: the step, the dead worker's error, and step 1's checkpoint with the
    resume command; the cluster's CPUs are free again. Before: Ray's ActorDiedError traceback."""
    from tether.ray import RolloutPool
    from tether.train.cli import main

    real, calls = RolloutPool.rollout, []

    def killing(pool, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            ray.kill(pool.workers[0], no_restart=True)
        return real(pool, *args, **kwargs)

    monkeypatch.setattr(RolloutPool, "rollout", killing)
    run = tmp_path / "ray"
    args = [f"{k}={v}" for k, v in tiny_cfg(run, checkpoint_every=1, steps=3).__dict__.items()]
    with pytest.warns(UserWarning, match="sampled KL"):
        assert main(["train", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    line = err.rstrip("\n").split("\n")[-1]
    assert line.startswith("tether train: step 2: a Ray rollout worker died (") and "ActorDied" in line, line
    assert line.endswith(f"the run stopped before the step's update. {run} holds the checkpoints of steps 1; "
                         f"continue with tether train --resume {run}."), line
    assert [r["step"] for r in MetricsLog(run / "metrics.jsonl").read()] == [1]
    assert wait_for_free_cpus(2.0) == 2.0
