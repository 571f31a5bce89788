"""``start_local_cluster``: the cluster tether starts (for these tests and for ``tether train``)
is reachable on 127.0.0.1 only; once Ray is shut down, no call of a tether Ray object starts
another; joining an address with nothing behind it fails within its timeout."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import ray
import torch
from tensordict import TensorDict

from tests.ray.factories import reference_scorer
from tests.ray.test_workers import tiny_cfg
from tether.ray import (
    RayKLRewardTransform,
    RayNotInitializedError,
    RayRetrieveKL,
    ReferenceService,
    RolloutPool,
    SamplingSettings,
    connect_cluster,
    start_local_cluster,
)
from tether.ray._runtime import is_loopback, probe
from tether.train.recipe_ray import start_workers
from tether.train.run import build_models

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]


def descendants(root: int) -> set[int]:
    """Every process below ``root`` (Ray's GCS, raylet, agents and workers descend from the driver)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name field may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def listening_sockets() -> list[tuple[str, set[int]]]:
    """``(local address, owning pids)`` of every listening TCP socket, from ``ss -ltnpH``."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    sockets = []
    for line in out.splitlines():
        columns = line.split()
        host = columns[3].rsplit(":", 1)[0]
        sockets.append((host, {int(pid) for pid in re.findall(r"pid=(\d+)", line)}))
    return sockets


def test_the_local_cluster_is_bound_to_the_loopback():
    """The node and GCS addresses are 127.0.0.1, and every TCP socket a Ray process of this
    session listens on (driver, GCS, raylet, agents, workers) is bound to a loopback address,
    not to the machine's routable address nor to all interfaces (``*`` / ``0.0.0.0``)."""
    [node] = ray.nodes()
    assert node["NodeManagerAddress"] == "127.0.0.1"
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")

    @ray.remote(num_cpus=0.5)
    def where() -> str:
        return ray.util.get_node_ip_address()

    assert ray.get(where.remote()) == "127.0.0.1"  # a worker process exists while we look
    if shutil.which("ss") is None or not Path("/proc").is_dir():
        pytest.skip("ss or /proc missing: the addresses were checked, the sockets cannot be")
    ours = descendants(os.getpid()) | {os.getpid()}
    ray_sockets = [(host, pids) for host, pids in listening_sockets() if pids & ours]
    if not ray_sockets:
        pytest.skip("ss shows no process of ours (no permission to see socket owners)")
    assert len({p for _, pids in ray_sockets for p in pids}) >= 3  # at least driver, GCS and raylet
    exposed = [(host, pids) for host, pids in ray_sockets if not is_loopback(host)]
    assert not exposed


def test_a_second_start_is_refused_and_hosts_are_classified():
    with pytest.raises(RuntimeError, match="already connected to Ray"):
        start_local_cluster(1)
    with pytest.raises(ValueError, match="num_cpus: expected a finite number > 0, got 0"):
        start_local_cluster(0)
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "[::ffff:127.0.0.1]", "localhost"]))
    assert not any(map(is_loopback, ["*", "0.0.0.0", "[::]", "192.0.2.2", "fd00::2", "example.org"]))


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 with nothing listening on it (bound, then released)."""
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        return probe_socket.getsockname()[1]


def entry_points(pool, transform, pending, cfg) -> dict[str, Callable[[], object]]:
    """Every public call of tether's Ray objects that talks to Ray, by the name its error gives."""
    service, client = pool.service, pool.client
    tokens, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.bool)
    batch = TensorDict({"reward": torch.zeros(1, 1)}, batch_size=[1])
    policy = build_models(cfg).policy
    return {
        "ReferenceClient.score": lambda: client.score(tokens, mask),
        "ReferenceClient.submit": lambda: client.submit(tokens, mask),
        "ReferenceClient.send": lambda: client.send(pending.request),
        "PendingScore.reply": pending.reply,
        "RayKLRewardTransform.kl_coef": lambda: transform.kl_coef,
        "RayKLRewardTransform.kl_coef ": lambda: setattr(transform, "kl_coef", 0.5),  # the setter
        "RayKLRewardTransform.forward": lambda: transform(batch),
        "ReferenceService.stats": service.stats,
        "ReferenceService.info": service.info,
        "ReferenceService.flush": service.flush,
        "ReferenceService.forward_calls": service.forward_calls,
        "ReferenceService.load_weights": lambda: service.load_weights({}),
        "RolloutPool.rollout": lambda: pool.rollout(policy, [[{"role": "user", "content": "1+1"}]] * 2, 0),
        "RolloutPool.push_weights": lambda: pool.push_weights(policy),
        "RolloutPool.sync_reference": lambda: pool.sync_reference(None),
        "ReferenceService": lambda: ReferenceService(ref_model_factory=reference_scorer),
        "RayRetrieveKL": lambda: RayRetrieveKL(ref_model_factory=reference_scorer),
        "RolloutPool": lambda: RolloutPool(num_workers=1, policy_factory=None, service=service,
                                           settings=SamplingSettings(), seed=0, group_size=2),
    }


def test_after_ray_shutdown_every_call_refuses_and_no_cluster_starts(tmp_path):
    """A rollout pool (service, client, one worker), a KL transform and a request in flight are
    built on the session cluster, then ``ray.shutdown()``. Each call that would reach Ray raises
    ``RayNotInitializedError`` naming that call and the fix (Ray's own call would start a new
    cluster listening on the machine's address); the ``shutdown()`` methods do nothing, since the
    actors ended with the connection. Joining a loopback address with nothing behind it fails at
    once with the reason. Afterwards Ray is still not initialised, no process joined the ones
    this test's process had, and none of them listens off the loopback. The session cluster is
    started again at the end, for the tests after this one."""
    cfg = tiny_cfg(tmp_path, workers=1)
    pool = start_workers(cfg)
    transform = RayKLRewardTransform(ref_model_factory=reference_scorer, num_cpus=0)
    pending = pool.client.submit(torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.bool))
    calls = entry_points(pool, transform, pending, cfg)
    try:
        ray.shutdown()
        before = descendants(os.getpid())
        for name, call in calls.items():
            fix = r"Ray is not initialised.*start_local_cluster\(num_cpus=2\).*ray\.init\(address="
            with pytest.raises(RayNotInitializedError, match=rf"^{re.escape(name.strip())}: {fix}"):
                call()
            assert not ray.is_initialized(), name
        for owner in (transform, pool, pool.service):
            owner.shutdown()
        address = f"127.0.0.1:{free_loopback_port()}"
        with pytest.raises(ConnectionError, match=rf"Ray address '{address}': nothing accepts connections"):
            connect_cluster(address, timeout_s=5)
        with pytest.raises(ValueError, match="address: expected HOST:PORT.*start_local_cluster"):
            connect_cluster("local", timeout_s=5)
        assert not ray.is_initialized()
        started = descendants(os.getpid()) - before
        assert not started, f"processes started after ray.shutdown(): {started}"
        if shutil.which("ss") is not None:
            ours = descendants(os.getpid()) | {os.getpid()}
            assert not [(host, pids) for host, pids in listening_sockets() if pids & ours and not is_loopback(host)]
    finally:
        if ray.is_initialized():  # a call that did start a cluster: not the session's
            ray.shutdown()
        start_local_cluster(2)


def test_a_probe_of_an_address_that_never_answers_gives_up_after_its_timeout():
    """A loopback listener whose accept queue is full drops further connection attempts, so a
    connect would wait for the kernel's retries (minutes); the probe stops after 0.5 s."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        clients = [socket.socket() for _ in range(3)]
        for client in clients:
            client.setblocking(False)
            client.connect_ex(("127.0.0.1", port))
        try:
            with pytest.raises(TimeoutError, match=rf"cluster: no answer from 127.0.0.1:{port}.*after 0.5 s"):
                probe("127.0.0.1", port, 0.5, "cluster")
        finally:
            for client in clients:
                client.close()
