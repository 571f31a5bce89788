"""Rollout workers on Ray: policy copies that sample whole prompt groups and score the reference
through one shared ``ReferenceService``.

``RolloutPool`` owns ``N`` ``RolloutWorker`` actors. Each step it ships the learner's trainable
weights to every worker, splits the prompts into ``N`` runs of whole groups, lets each worker
sample with a generator seeded from ``(seed, step, worker index)``, has the service score the
step's rows in one batch packed in id order (so the reference log-probs do not depend on which
worker finished first), and merges the shards in prompt order. A service that dies is rebuilt
by Ray; the pool pushes a moved reference again and re-scores rows that another instance
answered. The step in full is in the docs (``docs/design.md``).
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import ray
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import is_non_tensor
from torch import Tensor, nn

from tether.llm import chat_batch
from tether.llm.keys import REFERENCE_LOG_PROBS
from tether.models import ReferenceUpdater, TransformersWrapper
from tether.models.batch_io import read_objects, write_objects
from tether.models.weights import load_named
from tether.ops.checks import whole_number
from tether.ops.masks import even_slices
from tether.ray._runtime import (
    actor_resources,
    check_seconds,
    get_within,
    kill_if_connected,
    needs_ray,
    require_ray,
    wait_ready,
)
from tether.ray.reference_client import ReferenceClient
from tether.ray.reference_service import ReferenceService
from tether.rollout import MultiTurnRollout

__all__ = [
    "RolloutPool",
    "RolloutShard",
    "RolloutWorker",
    "SamplingSettings",
    "WorkerModel",
    "merge_batches",
    "split_groups",
    "worker_seed",
]

_PADDING_SIDE = "left"  # the in-process sampler's layout, kept by the merge


@dataclass(frozen=True)
class WorkerModel:
    """What a policy factory returns: the policy (eval mode) and its tokenizer."""

    model: nn.Module
    tokenizer: Any


@dataclass(frozen=True)
class SamplingSettings:
    """How workers sample. ``threads`` > 0 sets torch's intra-op threads in each worker. With
    ``tools`` (names in ``tether.rollout.TOOLS``) each chat is a multi-turn episode, as
    ``tether.rollout.MultiTurnRollout`` runs it with ``max_turns`` and ``max_tokens``."""

    temperature: float = 1.0
    max_new_tokens: int = 20
    threads: int = 0
    tools: tuple[str, ...] = ()
    max_turns: int = 4
    max_tokens: int | None = None


@dataclass(frozen=True)
class RolloutShard:
    """One worker's sampled rows (sampler outputs plus ``("ref_log_probs", "full")``, CPU).

    ``reference_version``: the service's weights version that scored those log-probs.
    """

    worker: int
    batch: TensorDict
    pad_id: int
    sample_seconds: float
    reference_seconds: float
    reference_version: str | None = None


def worker_seed(seed: int, step: int, worker: int) -> int:
    """A 63-bit generator seed from ``(seed, step, worker)``, equal in every process."""
    digest = hashlib.blake2b(f"tether/{seed}/{step}/{worker}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def split_groups(num_groups: int, num_workers: int) -> list[range]:
    """Contiguous runs of group indices, one per worker, sizes differing by at most one."""
    return [range(begin, end) for begin, end in even_slices(num_groups, num_workers)]


def _leaves(td: TensorDictBase, prefix: tuple = ()) -> dict[tuple, Any]:
    """Every tensor and non-tensor entry of ``td`` by its full key."""
    found: dict[tuple, Any] = {}
    for key, value in td.items():
        if isinstance(value, TensorDictBase) and not is_non_tensor(value):
            found.update(_leaves(value, prefix + (key,)))
        else:
            found[prefix + (key,)] = value
    return found


def _left_pad(value: Tensor, width: int, fill: int | float | bool) -> Tensor:
    out = value.new_full((value.shape[0], width, *value.shape[2:]), fill)
    out[:, width - value.shape[1] :] = value
    return out


def merge_batches(batches: list[TensorDictBase], *, pad_id: int) -> TensorDict:
    """Concatenate left-padded sampled batches along the rows, re-padding to a common width.

    Per-token entries (``[b, T, ...]``) are left-padded to the widest part, with ``pad_id``
    under ``"tokens"`` and 0 / False elsewhere; per-row entries are concatenated; non-tensor
    entries (texts, chats) are joined as lists.
    """
    leaves = [_leaves(b) for b in batches]
    keys = list(leaves[0])
    for i, part in enumerate(leaves[1:], start=1):
        if set(part) != set(keys):
            raise ValueError(
                f"batches[{i}]: expected the keys of batches[0] {sorted(keys)}, got {sorted(part)}. "
                "Every worker must run the same sampler."
            )
    out = TensorDict({}, batch_size=[sum(b.batch_size[0] for b in batches)])
    for key in keys:
        values = [part[key] for part in leaves]
        if not isinstance(values[0], Tensor):
            joined = [item for b in batches for item in read_objects(b, key, "one object per row")]
            write_objects(out, key, joined)
            continue
        if values[0].ndim >= 2:
            width = max(v.shape[1] for v in values)
            fill = pad_id if key[0] == "tokens" else 0
            values = [_left_pad(v, width, fill) for v in values]
        out.set(key, torch.cat(values))
    return out


class RolloutWorker:
    """Ray actor body: a policy copy that samples prompts and asks the service for reference log-probs."""

    def __init__(self, index: int, policy_factory: Callable[[], WorkerModel], reference: ReferenceClient,
                 settings: SamplingSettings) -> None:
        if settings.threads:
            torch.set_num_threads(settings.threads)
        built = policy_factory()
        if not isinstance(built, WorkerModel):
            raise TypeError(
                f"policy_factory: expected it to return a tether.ray.WorkerModel(model, tokenizer), "
                f"got {type(built).__name__}."
            )
        self.index = index
        self.policy = built.model.eval()
        self.tokenizer = built.tokenizer
        self.reference = reference
        self.settings = settings

    def ready(self) -> int:
        return os.getpid()

    def load_weights(self, state: dict[str, Tensor]) -> int:
        """Copy named parameters from the learner; returns how many were copied."""
        return load_named(self.policy, state, owner=f"worker {self.index}'s policy",
                          fix="Build the workers' policies with the learner's configuration.")

    def sample(self, chats: list, seed: int, request_id: str, group: str, group_rows: int) -> RolloutShard:
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(seed)
        sampler = TransformersWrapper(
            self.policy, self.tokenizer, generate=True, temperature=self.settings.temperature,
            padding_side=_PADDING_SIDE,
            generate_kwargs={"max_new_tokens": self.settings.max_new_tokens, "generator": generator},
        )
        batch = chat_batch(chats, key=("history", "prompt"))
        settings = self.settings
        rollout = sampler if not settings.tools else MultiTurnRollout(
            sampler, list(settings.tools), max_turns=settings.max_turns, max_tokens=settings.max_tokens)
        with torch.no_grad():
            rollout(batch)
        sampled = time.perf_counter()
        reply = self.reference.submit(batch["tokens", "full"], batch["masks", "all_attention_mask"],
                                      request_id=request_id, group=group, group_rows=group_rows).reply()
        batch.set(REFERENCE_LOG_PROBS, reply.log_probs)
        return RolloutShard(self.index, batch, sampler.pad_id, sampled - start, time.perf_counter() - sampled,
                            reply.weights_version)


class RolloutPool:
    """``num_workers`` rollout actors sharing ``service``; see the module docstring.

    Keyword Args:
        num_workers: how many ``RolloutWorker`` actors (>= 1).
        policy_factory: picklable callable returning a ``WorkerModel``, called in each worker;
            its parameter names must match the learner policy's.
        service: the ``ReferenceService`` the workers score the reference with.
        settings: sampling temperature, response length and threads.
        seed: base of the per-(step, worker) sampling seeds.
        group_size: answers per prompt (rows come in whole groups of this size).
        num_cpus: Ray CPUs each worker holds.
        owns_ray: ``shutdown()`` also disconnects from Ray (set when the pool's creator started it).
        ready_timeout_s: longest the constructor waits for every worker to be placed and built.
        timeout_s: longest a step waits for the workers (weights loaded, shards sampled and
            scored) and for each answer of the service.
        poll_s: how often the pool checks, while workers sample, whether the service restarted.
    """

    def __init__(self, *, num_workers: int, policy_factory: Callable[[], WorkerModel], service: ReferenceService,
                 settings: SamplingSettings, seed: int, group_size: int, num_cpus: float = 1.0,
                 owns_ray: bool = False, ready_timeout_s: float = 300.0, timeout_s: float = 600.0,
                 poll_s: float = 1.0) -> None:
        self._closed = False
        self.workers: list = []
        self.service = service
        self.owns_ray = owns_ray
        require_ray(type(self).__name__)
        whole_number("num_workers", num_workers, low=1)
        whole_number("group_size", group_size, low=1)
        check_seconds("ready_timeout_s", ready_timeout_s)
        self.timeout_s = check_seconds("timeout_s", timeout_s)
        resources = actor_resources(num_cpus, 0)
        body = ray.remote(RolloutWorker).options(**resources, max_restarts=0)
        client = service.client()
        self.client = client
        self.seed = seed
        self.group_size = group_size
        self.poll_s = check_seconds("poll_s", poll_s)
        self.last_shards: list[RolloutShard] = []
        self._tag = uuid.uuid4().hex[:8]
        self._calls = 0
        self._reference_version: str | None = None  # what the service must hold; None: its own
        self._reference_updater: ReferenceUpdater | None = None
        try:
            self.workers = [body.remote(w, policy_factory, client, settings) for w in range(num_workers)]
            # Report a failing factory, or workers that cannot be placed, here.
            wait_ready([w.ready.remote() for w in self.workers], what=f"{type(self).__name__} workers",
                       timeout_s=ready_timeout_s, resources=resources)
        except BaseException:
            self.shutdown()  # the workers that did start, and the service, hold CPUs
            raise

    @needs_ray
    def push_weights(self, policy: nn.Module) -> list:
        """Send the policy's trainable parameters to every worker; returns the pending loads."""
        state = {n: p.detach().to("cpu").clone() for n, p in policy.named_parameters() if p.requires_grad}
        shared = ray.put(state)
        return [w.load_weights.remote(shared) for w in self.workers]

    @needs_ray
    def sync_reference(self, updater: ReferenceUpdater | None) -> int:
        """Send a moving reference's tensors to the service unless it holds them already.

        The service reports the version it holds, so a rebuilt service (version None) gets
        them again. Returns the pid of the service instance asked.
        """
        info = self.service.info()
        if updater is None or not updater.tracked:
            self._reference_version = self._reference_updater = None
            return info.pid
        self._reference_updater = updater
        # The updater's identity too: another updater at the same count holds other weights.
        self._reference_version = f"{self._tag}/{id(updater):x}/{updater.num_updates}"
        if info.weights_version != self._reference_version:
            self._push_reference()
        return info.pid

    def _push_reference(self) -> None:
        moved = {name: t.to("cpu") for name, t in self._reference_updater.state_dict()["reference"].items()}
        self.service.load_weights(ray.put(moved), self._reference_version)

    def _collect(self, pending: list, service_pid: int) -> list[RolloutShard]:
        """The workers' shards; flushes the service's batch whenever a restarted instance serves the step."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            _, waiting = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, min(self.poll_s, left)))
            if not waiting:
                return ray.get(pending)
            if left <= 0:
                raise TimeoutError(
                    f"{type(self).__name__}.rollout: {len(waiting)} of the {len(pending)} workers' shards "
                    f"are not back after {self.timeout_s:g} s. The workers or the reference service "
                    "may be stuck or overloaded; check their logs, or raise timeout_s (tether train: ray_timeout)."
                )
            # A new instance never sees the rows its predecessor answered, so the step's group
            # would never fill and the batch would wait out max_wait_ms.
            if self.service.info().pid != service_pid:
                self.service.flush()

    def _rescore_stale(self, shards: list[RolloutShard], attempts: int = 3) -> list[RolloutShard]:
        """Score again, after a new push, the shards a restarted service scored with its factory's weights."""
        if self._reference_version is None:  # nothing pushed: whatever the service holds is the reference
            return shards
        for attempt in range(1, attempts + 1):
            stale = [i for i, s in enumerate(shards) if s.reference_version != self._reference_version]
            if not stale:
                return shards
            self._push_reference()
            group = f"{self._tag}-r{self._calls:09d}-x{attempt}"
            rows = sum(shards[i].batch.batch_size[0] for i in stale)
            pending = [(i, self.client.submit(shards[i].batch["tokens", "full"],
                                              shards[i].batch["masks", "all_attention_mask"],
                                              request_id=f"{group}-w{shards[i].worker:05d}", group=group,
                                              group_rows=rows)) for i in stale]
            for i, request in pending:
                reply = request.reply()
                shards[i].batch.set(REFERENCE_LOG_PROBS, reply.log_probs)
                shards[i] = replace(shards[i], reference_version=reply.weights_version)
        if any(s.reference_version != self._reference_version for s in shards):
            raise RuntimeError(
                f"the reference service lost the pushed reference weights (version "
                f"{self._reference_version!r}) {attempts} times in one step; it keeps restarting. "
                "Check its logs (memory, a crashing factory)."
            )
        return shards

    @needs_ray
    def rollout(self, policy: nn.Module, chats: list, step: int, *,
                reference_updater: ReferenceUpdater | None = None) -> TensorDict:
        """Sample ``chats`` (whole groups, in order) on the workers with the policy's current weights."""
        if len(chats) % self.group_size:
            raise ValueError(
                f"chats: expected whole groups of group_size={self.group_size}, got {len(chats)} rows."
            )
        service_pid = self.sync_reference(reference_updater)
        loads = self.push_weights(policy)
        self._calls += 1
        group = f"{self._tag}-r{self._calls:09d}"
        pending = []
        for w, groups in enumerate(split_groups(len(chats) // self.group_size, len(self.workers))):
            if not groups:
                continue
            rows = chats[groups.start * self.group_size : groups.stop * self.group_size]
            pending.append(self.workers[w].sample.remote(rows, worker_seed(self.seed, step, w), f"{group}-w{w:05d}",
                                                         group, len(chats)))
        get_within(loads, what=f"{type(self).__name__}.rollout: loading the weights on the workers",
                   timeout_s=self.timeout_s, fix="Check the workers' logs, or raise timeout_s (tether train: ray_timeout).")
        self.last_shards = self._rescore_stale(self._collect(pending, service_pid))
        return merge_batches([s.batch for s in self.last_shards], pad_id=self.last_shards[0].pad_id)

    def shutdown(self) -> None:
        """Kill the workers and the service (and disconnect from Ray when the pool owns it).

        Safe to call again, and after Ray was shut down: later calls do nothing.
        """
        if self._closed:
            return
        self._closed = True
        kill_if_connected(*self.workers)
        self.service.shutdown()
        self.workers = []
        if self.owns_ray:
            ray.shutdown()
