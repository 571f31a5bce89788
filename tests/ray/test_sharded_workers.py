"""A sharded learner with Ray rollout workers (issue 16): ``torchrun --nproc_per_node 2 -m
tether.train --workers 2`` (rank 0 owns the pool and hands each rank its block of the step's
rows) ends with the weights and metrics of ``--workers 2`` in one process; a failure on rank 0
stops rank 1 with its cause instead of leaving it waiting for rows.

The one-process run uses the session's cluster; the sharded run's rank 0 starts its own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.train.test_recipe import _metrics
from tests.train.test_sharded import SRC, _assert_same_run, _flags, _sharded
from tether.train import recipe_ray
from tether.train.launch import free_port
from tether.train.config import TrainConfig

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]


def test_two_ranks_with_two_workers_equal_one_process_with_two_workers(tmp_path):
    """Float64 tiny model, full fine-tuning, 2 steps, 4 prompts x 2 answers on 2 workers. The
    workers sample from (seed, step, worker) with the pushed weights, and the service scores the
    whole step in one batch, in both runs; so the rollouts are the same, and the sharded update
    (each rank's block, full-batch denominators, summed gradients) must equal the one-process
    update: weights within 1e-10 and every logged value equal (1e-12). With dynamic sampling and
    a 0/1 reward, steps draw again: each rank's extra problems reach the workers through rank 0
    (sampling the step's first problems again instead would pair answers with the wrong
    problems and part from the one-process run)."""
    reward = tmp_path / "reward.py"
    reward.write_text("def odd_majority(prompts, completions, **_):\n"
                      "    texts = [c[-1]['content'] for c in completions]\n"
                      "    return [float(sum(ord(c) % 2 for c in t) * 2 > len(t)) for t in texts]\n")
    kw = dict(workers=2, kl_signal="sampled",  # the service returns log-probs only
              dynamic_sampling=True, max_resample=2, reward_funcs=str(reward))
    recipe_ray.train(TrainConfig(**_flags(tmp_path / "one", **kw)), progress=False)
    _assert_same_run(tmp_path / "one", _sharded(tmp_path / "two", **kw), 1e-10)
    assert any(r["groups_drawn"] > 4 for r in _metrics(tmp_path / "one"))


def test_rank_zero_failing_to_start_the_workers_stops_every_rank_with_the_cause(tmp_path):
    """``ray_address`` where nothing listens: rank 0's connect fails after ``ray_timeout``; rank 1,
    which never talks to Ray, raises too, naming rank 0's error, and the launch exits non-zero
    well within the guard instead of hanging in the step's scatter."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    flags = _flags(tmp_path / "two", workers=1, kl_signal="sampled", ray_address=address, ray_timeout=5.0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "tether.train", "--quiet", *[f"{k}={v}" for k, v in flags.items()]]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "rank 0 failed, so rank 1 stops too: " in done.stderr, done.stderr[-3000:]
    assert f"Ray address '{address}': nothing accepts connections at" in done.stderr
    assert not list((tmp_path / "two").glob("checkpoints/*"))
