"""Run by ``test_two_nodes.py`` in its own process (the session's Ray cluster must not be
connected): ``train --workers 2`` on a Ray cluster of two nodes against the one-node run.

The two-node cluster is ``ray.cluster_utils.Cluster`` on 127.0.0.1: a head of 1 CPU and a
second node of 2 CPUs, and the run joins it through ``ray_address`` as it would a real
cluster. The service and the 2 workers hold 1 CPU each (``recipe_ray._cpu_share``: 3 actors,
3 free CPUs), so they fill both nodes and the second node holds at least one worker; each
actor reports the node it runs on (``get_node_id``). The one-node run is ``tether train``'s
own local cluster of ``max(2, workers + 1)`` = 3 CPUs. Prints one line per finding; exits 1 on
a mismatch.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from tests.ray.test_workers import tiny_cfg
from tests.train.test_recipe import _metrics, _weights
from tether._compat import ray_cluster_mode_off
from tether.train import recipe_ray

PLACED: dict[str, str] = {}


def _node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id()))


def recording(start):
    """``start_workers`` that notes the node of the service and of each worker it started."""

    def started(cfg, tool_use=None):
        pool = start(cfg, tool_use)
        PLACED["service"] = _node_of(pool.service.actor)
        PLACED.update({f"worker {i}": _node_of(w) for i, w in enumerate(pool.workers)})
        return pool

    return started


def two_node_run(out: Path) -> tuple[str, str]:
    node = dict(node_ip_address="127.0.0.1", include_dashboard=False)
    with ray_cluster_mode_off():
        cluster = Cluster(initialize_head=True, head_node_args={**node, "num_cpus": 1})
        second = cluster.add_node(**node, num_cpus=2)
    nodes = cluster.head_node.node_id, second.node_id
    try:
        cluster.wait_for_nodes()
        recipe_ray.train(run_cfg(out, ray_address=cluster.address), progress=False)
    finally:
        cluster.shutdown()
    return nodes


def run_cfg(out: Path, **kw):
    return tiny_cfg(out, dtype="float64", kl_signal="sampled", checkpoint_every=2, learning_rate=1e-2, **kw)


def main() -> int:
    recipe_ray.start_workers = recording(recipe_ray.start_workers)
    root = Path(tempfile.mkdtemp(prefix="tether-two-nodes-"))
    recipe_ray.train(run_cfg(root / "one"), progress=False)  # tether's own one-node local cluster
    head, second = two_node_run(root / "two")
    ok = True
    workers_there = [k for k, v in PLACED.items() if k.startswith("worker") and v == second]
    print(f"placed: {sorted(k for k in PLACED if PLACED[k] == head)} on the head, {sorted(k for k in PLACED if PLACED[k] == second)} on the second node")
    if not workers_there or set(PLACED.values()) != {head, second}:
        ok = False
        print("placement: expected both nodes used and a worker on the second node")
    a, b = _weights(root / "one"), _weights(root / "two")
    gap = max(float((a[k] - b[k]).abs().max()) for k in a) if a.keys() == b.keys() else float("inf")
    print(f"weights: largest difference {gap:.3g}")
    ok &= gap <= 1e-10
    ma, mb = _metrics(root / "one"), _metrics(root / "two")
    same = [sorted(r) for r in ma] == [sorted(r) for r in mb] and all(
        abs(ra[k] - rb[k]) <= 1e-12 * max(1.0, abs(ra[k])) if isinstance(ra[k], float) else ra[k] == rb[k]
        for ra, rb in zip(ma, mb) for k in ra)
    print(f"metrics: {'same' if same else 'differ'} ({len(ma)} steps)")
    return 0 if ok and same else 1


if __name__ == "__main__":
    sys.exit(main())
