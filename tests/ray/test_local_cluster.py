"""``start_local_cluster``: the cluster tether starts (for these tests and for ``tether train``)
is reachable on 127.0.0.1 only."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import ray

from tether.ray import start_local_cluster
from tether.ray._runtime import is_loopback

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
    with pytest.raises(ValueError, match="num_cpus: expected a number > 0"):
        start_local_cluster(0)
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "[::ffff:127.0.0.1]", "localhost"]))
    assert not any(map(is_loopback, ["*", "0.0.0.0", "[::]", "192.0.2.2", "fd00::2", "example.org"]))
