"""Two "nodes" on this machine: torchrun's multi-node launch (c10d rendezvous on 127.0.0.1)
against the one-node ``--nproc 2`` run.

Each node is its own ``torchrun --nnodes 2 --nproc-per-node 1`` process, as on two hosts, and
both meet at a c10d rendezvous on a free loopback port; the world they form is the one-node
run's (2 ranks, gloo), so 2 steps of the tiny float64 model end with the weights within 1e-10
and every logged value equal (``test_sharded._assert_same_run``, the sharded tests' tolerance).
The rendezvous decides which node's process is rank 0; both "nodes" see one run directory here,
as hosts sharing a filesystem would (docs/scaling.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.train.test_sharded import SRC, _assert_same_run, _flags, _sharded
from tether.train.launch import free_port


def node_command(out: Path, port: int, node_rank: int) -> list[str]:
    """The line a user runs on host ``node_rank`` (torchrun's own flags; docs/scaling.md)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
            f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=tether-two-nodes", "-m", "tether.train", "--quiet",
            *[f"{k}={v}" for k, v in _flags(out).items()]]


def test_two_nodes_of_one_rank_equal_one_node_of_two(tmp_path):
    one = _sharded(tmp_path / "one")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    port = free_port()
    nodes = [subprocess.Popen(node_command(tmp_path / "two", port, r), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    _assert_same_run(one, tmp_path / "two", 1e-10)
