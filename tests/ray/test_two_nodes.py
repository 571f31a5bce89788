"""``tether train --workers 2`` on a Ray cluster of two nodes (``ray.cluster_utils.Cluster`` on
127.0.0.1, joined through ``ray_address``) against the one-node run: the weights within 1e-10
(the sharded tests' tolerance) and every logged value equal, with a worker placed on the
second node. The runs are in ``two_node_check.py``, in its own process: this session's Ray
cluster (conftest) may be connected, and a process joins one cluster at a time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ROOT = Path(__file__).parents[2]


def test_workers_on_two_nodes_equal_one_node():
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "tests.ray.two_node_check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "weights: largest difference" in done.stdout and "metrics: same (2 steps)" in done.stdout
    placed = next(line for line in done.stdout.splitlines() if line.startswith("placed:"))
    assert "'worker" in placed.split("on the head,")[1], placed
