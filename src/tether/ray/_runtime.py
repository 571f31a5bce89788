"""Ray plumbing shared by ``tether.ray``: the cluster check, a loopback-only local cluster,
named actors, resources, devices.

tether never starts a Ray cluster as a side effect: ``require_ray`` (and the ``needs_ray``
decorator) raises ``RayNotInitializedError`` with the line to run instead; only an explicit
``start_local_cluster(num_cpus)`` starts one, bound to 127.0.0.1 (a plain local ``ray.init()``
binds to the machine's routable address on Linux; ``docs/design.md`` has why). Every wait is
bounded: ``connect_cluster`` checks that something listens, ``get_within`` / ``wait_ready``
turn Ray's timeout into a ``TimeoutError`` naming what was awaited and the knob to raise.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import Tensor

from tether._compat import ray_cluster_mode_off, ray_dial_address
from tether.ops.checks import real_number

try:
    import ray
except ImportError as exc:  # Ray is an optional extra
    raise ImportError(
        "tether.ray needs Ray, which is not installed. Install the extra: pip install 'tether[ray]'."
    ) from exc

__all__ = [
    "ActorLookup",
    "RayNotInitializedError",
    "actor_resources",
    "caller_device",
    "check_seconds",
    "connect_cluster",
    "get_or_create_actor",
    "get_within",
    "is_loopback",
    "kill_if_connected",
    "needs_ray",
    "probe",
    "place_scorer",
    "remote_device",
    "require_ray",
    "start_local_cluster",
    "wait_ready",
]

_LOOPBACK = "127.0.0.1"


class RayNotInitializedError(RuntimeError):
    """A Ray-backed component was built while no Ray cluster is connected."""


def require_ray(what: str) -> None:
    """Raise ``RayNotInitializedError`` unless this process is connected to a Ray cluster."""
    if not ray.is_initialized():
        raise RayNotInitializedError(
            f"{what}: Ray is not initialised in this process, and tether does not start a cluster "
            "implicitly. Start a local one first with tether.ray.start_local_cluster(num_cpus=2) "
            "(bound to 127.0.0.1), or join an existing cluster with ray.init(address='HOST:PORT')."
        )


def needs_ray(method: Callable) -> Callable:
    """Run ``require_ray`` before ``method``, naming ``Class.method`` in the error.

    Ray's ``get``, ``put``, ``kill`` and actor calls start a new local cluster when none is
    connected (listening beyond the loopback); a method decorated here refuses instead.
    """

    @functools.wraps(method)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        require_ray(f"{type(self).__name__}.{method.__name__}")
        return method(self, *args, **kwargs)

    return checked


def kill_if_connected(*actors: Any) -> None:
    """Kill ``actors`` for good; without a Ray connection do nothing.

    Non-detached actors end with the connection that owned them, and ``ray.kill`` without
    one would start a new local cluster, so a shutdown after ``ray.shutdown()`` is a no-op.
    """
    if ray.is_initialized():
        for actor in actors:
            ray.kill(actor, no_restart=True)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP, ``[v6]``, ``::ffff:`` mapped v4 or ``localhost``) is the loopback."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _addresses() -> dict[str, str]:
    """The GCS address and every node's address of the connected cluster, by what they are."""
    found = {"gcs": ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]}
    for i, node in enumerate(ray.nodes()):
        found[f"node {i}"] = node["NodeManagerAddress"]
    return found


def start_local_cluster(num_cpus: Any) -> None:
    """Start a one-node Ray cluster in this process, reachable on 127.0.0.1 only.

    No dashboard. Raises ``RuntimeError`` when this process is already connected to Ray, or
    when the cluster came up on another address (it is shut down again first).
    """
    cpus = real_number("num_cpus", num_cpus, low=0, low_open=True, fix="A local cluster needs at least part of a CPU.")
    if ray.is_initialized():
        raise RuntimeError(
            "start_local_cluster: this process is already connected to Ray; use that connection, "
            "or call ray.shutdown() first."
        )
    # The node address is computed once, in this process, by get_node_ip_address (see the
    # module docstring) and handed to GCS, raylet and workers; with Ray's cluster flag off
    # (tether._compat) it is the loopback, and the check below judges what was bound.
    with ray_cluster_mode_off():
        ray.init(num_cpus=cpus, include_dashboard=False, _node_ip_address=_LOOPBACK)
    exposed = {what: host for what, host in _addresses().items() if not is_loopback(host)}
    if exposed:  # a Ray release that computes the address elsewhere: refuse rather than expose
        ray.shutdown()
        raise RuntimeError(
            f"start_local_cluster: Ray bound {exposed} instead of {_LOOPBACK}, so the cluster was "
            "reachable from the network; it has been shut down. Start a cluster whose network "
            "exposure you control and connect to it instead (ray_address=HOST:PORT, or ray.init(address=...))."
        )


@dataclass(frozen=True)
class ActorLookup:
    """A Ray actor handle and whether this call created the actor (False: found by name)."""

    handle: Any  # ray.actor.ActorHandle
    created: bool


def get_or_create_actor(
    body: type,
    *,
    name: str | None,
    options: dict[str, Any],
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
) -> ActorLookup:
    """The actor called ``name`` if it exists, else a new actor of class ``body``.

    An existing actor is reused as it is: its model and settings stay those it was built with.
    ``get_if_exists`` closes the race between two callers creating the same name at once.
    """
    if name is not None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"actor_name: expected a non-empty string or None, got {name!r}.")
        try:
            return ActorLookup(ray.get_actor(name), created=False)
        except ValueError:  # Ray's answer for "no actor with that name"
            options = {**options, "name": name, "get_if_exists": True}
    handle = ray.remote(body).options(**options).remote(*args, **(kwargs or {}))
    return ActorLookup(handle, created=True)


def _check_amount(name: str, value: Any) -> float:
    return real_number(name, value, low=0, fix="Pass the amount of this Ray resource the actor holds.")


def actor_resources(num_cpus: Any, num_gpus: Any) -> dict[str, float]:
    """Validated ``num_cpus`` / ``num_gpus`` actor options (held for the actor's lifetime)."""
    cpus = _check_amount("num_cpus", num_cpus)
    gpus = _check_amount("num_gpus", num_gpus)
    if gpus > 1 and gpus != int(gpus):
        raise ValueError(f"num_gpus: Ray accepts fractions only below 1, got {gpus}; use a whole number.")
    return {"num_cpus": cpus, "num_gpus": gpus}


def check_seconds(name: str, value: Any) -> float:
    """A finite duration in seconds, > 0 (checked before any actor is created, so a typo leaks none)."""
    return real_number(name, value, low=0, low_open=True, fix="Pass a duration in seconds.")


def get_within(refs: Any, *, what: str, timeout_s: float, fix: str | Callable[[], str],
               on_timeout: Callable[[], None] | None = None, state: str = "no answer") -> Any:
    """``ray.get(refs)`` bounded by ``timeout_s``; past it a ``TimeoutError``: "``what``: ``state``
    after ``timeout_s`` s", then ``fix``.

    ``fix`` (or what it returns, computed only on a timeout) says which knob to raise or what
    to check; ``on_timeout`` runs before the error is raised (to kill actors left hanging).
    """
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        hint = fix() if callable(fix) else fix
        if on_timeout is not None:
            on_timeout()
        raise TimeoutError(f"{what}: {state} after {timeout_s:g} s. {hint}") from None


def wait_ready(refs: list, *, what: str, timeout_s: float, resources: dict[str, float],
               on_timeout: Callable[[], None] | None = None) -> list:
    """``get_within`` for actors' first calls: the error says why an actor may never come up.

    Ray keeps an actor pending, silently, while the cluster lacks the resources it asked for,
    so an unbounded wait would hang the caller; a request over the whole cluster's resources
    fails at once (``ValueError``) instead of after ``timeout_s``.
    """
    check_seconds("ready_timeout_s", timeout_s)
    total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    if resources["num_cpus"] > total.get("CPU", 0.0) or resources["num_gpus"] > total.get("GPU", 0.0):
        if on_timeout is not None:
            on_timeout()
        raise ValueError(
            f"{what}: the actor asked for {resources} and the whole Ray cluster has {total}, so it could never "
            "be placed (Ray would keep it pending). Ask for less (on a CPU machine: num_gpus=0, device='cpu'), "
            "or start the cluster with the resources (a cluster that adds nodes on demand: have one such node up)."
        )

    def fix() -> str:
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        return (f"Each actor asked for {resources} and the cluster has {free} "
                "free now; Ray keeps an actor waiting until its resources are free. Use a larger "
                "cluster or smaller requests, or raise ready_timeout_s if the model is slow to build.")

    return get_within(refs, what=what, timeout_s=timeout_s, fix=fix, on_timeout=on_timeout, state="not ready")


def _dial_target(address: str) -> tuple[str, int]:
    """The host and port ``ray.init(address=address)`` will connect to."""
    if address.startswith("ray://"):  # Ray Client: its server's address, used as given
        target = address[len("ray://"):]
    else:  # Ray maps a loopback host to the machine's address and "auto" to the recorded cluster
        try:
            target = ray_dial_address(address)
        except (ValueError, ConnectionError) as exc:
            raise ValueError(
                f"address={address!r}: expected HOST:PORT of a running Ray cluster's head (or "
                f"ray://HOST:PORT, or 'auto'); Ray could not use it: {exc}"
            ) from None
    host, sep, port = (target or "").rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address={address!r}: expected HOST:PORT (e.g. 10.0.0.5:6379), got {target!r}.")
    return host.strip("[]"), int(port)


def probe(host: str, port: int, timeout_s: float, what: str) -> None:
    """Open (and close) a TCP connection to ``host:port`` within ``timeout_s``, or say why not."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except TimeoutError:
        raise TimeoutError(
            f"{what}: no answer from {host}:{port}, the address Ray dials for it, after {timeout_s:g} s. "
            "Check that the cluster's head is up and reachable from here, or raise the timeout "
            "(tether train: ray_timeout)."
        ) from None
    except OSError as exc:
        raise ConnectionError(
            f"{what}: nothing accepts connections at {host}:{port}, the address Ray dials for it "
            f"({exc.strerror or exc}). Start the cluster there (ray start --head --port={port}), correct "
            "the address, or leave it out to start a local cluster bound to 127.0.0.1."
        ) from None


def connect_cluster(address: Any, timeout_s: Any) -> None:
    """Join the existing Ray cluster at ``address``, or fail within ``timeout_s`` with the reason.

    ``ray.init(address=...)`` waits for ever when nothing answers there, so the address Ray
    will dial is first probed with a TCP connection bounded by ``timeout_s``. ``'local'`` is
    refused: it would start a cluster reachable from the network (use ``start_local_cluster``).
    """
    seconds = check_seconds("timeout_s", timeout_s)
    if not isinstance(address, str) or not address.strip() or address.strip() == "local":
        raise ValueError(
            f"address: expected HOST:PORT of an existing Ray cluster, got {address!r}. For a local "
            "cluster bound to 127.0.0.1 call start_local_cluster(num_cpus) (tether train: leave "
            "ray_address empty)."
        )
    if ray.is_initialized():
        raise RuntimeError(f"connect_cluster({address!r}): this process is already connected to Ray.")
    # Ray dials a loopback address at the machine's routable one (``_dial_target``); a cluster on
    # this machine bound to 127.0.0.1 (``ray.cluster_utils.Cluster``, a test's second node)
    # listens on the loopback only, so a loopback address is dialled as given.
    given = address.strip().rpartition(":")[0]
    keep = ray_cluster_mode_off() if is_loopback(given) else contextlib.nullcontext()
    with keep:
        host, port = _dial_target(address.strip())
        probe(host, port, seconds, f"Ray address {address!r}")
        ray.init(address=address.strip())


def remote_device(device: Any, num_gpus: float) -> torch.device | None:
    """The device the actor computes on; a CUDA device needs a GPU reserved for the actor."""
    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda:0', got {device!r}.") from exc
    if resolved.type == "cuda" and num_gpus <= 0:
        raise ValueError(
            f"device={device!r} with num_gpus={num_gpus}: Ray hides every GPU from an actor that "
            "reserves none. Pass num_gpus=1 (or a fraction) together with a CUDA device."
        )
    return resolved


def place_scorer(scorer: Any, device: torch.device | None) -> None:
    """Move a scoring wrapper's model to ``device`` inside an actor; refuse a wrapper pinned elsewhere."""
    if scorer is None or device is None:
        return
    scorer.model.to(device)
    if scorer.device.type != device.type:
        raise ValueError(
            f"device={str(device)!r}: the scorer was built with device={str(scorer.device)!r} and "
            "keeps sending its inputs there. Build it without a device (or with this one)."
        )


def caller_device(td: TensorDictBase) -> torch.device:
    """Where the caller's batch lives: its declared device, else that of its first tensor."""
    if td.device is not None:
        return td.device
    for value in td.values(include_nested=True, leaves_only=True):
        if isinstance(value, Tensor):
            return value.device
    return torch.device("cpu")
