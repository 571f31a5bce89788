"""``ReferenceService``: one Ray actor holding the reference model, batching its callers' requests.

Rollout workers send ``(tokens, mask)`` through a ``ReferenceClient``. The actor (an asyncio
actor, so requests keep arriving while a forward pass runs) queues them; a batch closes when
the queued rows or tokens reach ``max_batch_rows`` / ``max_batch_tokens``, when every row of
the oldest queued request's group has arrived (``ScoreRequest.group_rows``), when a caller
calls ``flush()``, or when ``max_wait_ms`` has passed since it opened (at its first request,
or at the end of the previous forward pass for requests that queued meanwhile). The closed
batch's rows, in request-id order, are packed into one right-padded grid and scored by a
single ``TransformersWrapper.score`` call (padding-free, length-sorted micro-batches inside);
each caller gets its own rows back in its own layout. ``forward_calls()`` counts those calls.
``load_weights`` runs on the same single thread as the forward passes, so a batch is scored
wholly with the old weights or wholly with the new ones, and its replies carry the version
given with the weights.

Fault tolerance: the actor is created with ``max_restarts`` and ``max_task_retries``, so
when it dies Ray builds a new one from the same arguments (``ref_model_factory`` rebuilds the
model there) and resubmits the calls that were in flight; ``ReferenceClient`` resends under
the same request id if an error still surfaces. Answers are cached by request id, so a
repeated id is never scored twice by one instance, and each caller receives one answer. A
rebuilt actor has its factory's weights again (``weights_version`` None in its replies and
``info()``): weights loaded since must be sent again.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
import torch
from torch import Tensor

from tether.llm.retrieve_kl import resolve_reference
from tether.models import TransformersWrapper
from tether.ray._checks import check_model_args
from tether.ray._packing import pack_rows, unpack_rows
from tether.ray._runtime import (
    actor_resources,
    check_seconds,
    get_or_create_actor,
    place_scorer,
    remote_device,
    require_ray,
    wait_ready,
)
from tether.ray.reference_client import ReferenceClient, ScoreReply, ScoreRequest

__all__ = ["BatchLimits", "ReferenceService", "ServiceInfo", "ServiceStats"]

_KIND = "ReferenceService"
_GROUPS_KEPT = 64  # groups whose arrived rows are counted; older ones are long closed


@dataclass(frozen=True)
class BatchLimits:
    """When a batch of requests closes. ``None`` removes a size limit."""

    max_wait_ms: float = 5.0
    max_batch_rows: int | None = None
    max_batch_tokens: int | None = None  # rows * longest row of the packed grid

    def __post_init__(self) -> None:
        if not self.max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms: expected a number >= 0, got {self.max_wait_ms!r}.")
        for name in ("max_batch_rows", "max_batch_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: expected an int >= 1 or None (no limit), got {value!r}.")


@dataclass(frozen=True)
class ServiceStats:
    """Counters of one service instance (they restart from 0 when the actor is rebuilt)."""

    pid: int
    forward_calls: int
    requests_scored: int
    rows_scored: int
    repeats_answered: int  # requests whose id was already answered or in flight
    answered_ids: list[str]  # the ids in the answer cache, oldest first
    queued_ids: list[str]  # ids waiting for a batch to close (not yet in a forward pass)
    weights_version: str | None


@dataclass(frozen=True)
class ServiceInfo:
    """What a service instance is, cheaply: no per-request data."""

    kind: str
    pid: int
    weights_version: str | None  # of the last load_weights; None: the weights it was built with


@dataclass
class _Waiting:
    request: ScoreRequest
    future: asyncio.Future
    digest: str


@dataclass(frozen=True)
class _Answer:
    reply: ScoreReply
    digest: str


def _row_length(mask: Tensor) -> int:
    return int(mask.sum(-1).max()) if mask.numel() else 0


class ReferenceServer:
    """Ray actor body of ``ReferenceService`` (see the module docstring)."""

    def __init__(self, ref_model: TransformersWrapper | None,
                 ref_model_factory: Callable[[], TransformersWrapper] | None, limits: BatchLimits,
                 device: torch.device | None, answer_cache: int) -> None:
        self.scorer = resolve_reference(ref_model, ref_model_factory)
        place_scorer(self.scorer, device)
        self.limits = limits
        self.answer_cache = answer_cache
        self._queue: list[_Waiting] = []
        self._in_flight: dict[str, _Waiting] = {}
        self._answers: OrderedDict[str, _Answer] = OrderedDict()
        self._arrived: OrderedDict[str, int] = OrderedDict()  # rows received per request group
        self._wake = asyncio.Event()
        self._drainer: asyncio.Task | None = None
        # One thread runs the forward passes, so the event loop keeps accepting requests;
        # weight loads go to the same thread, so they never overlap a forward pass.
        self._executor = ThreadPoolExecutor(max_workers=1)
        self._weights_version: str | None = None
        self._forward_calls = 0
        self._requests = 0
        self._rows = 0
        self._repeats = 0

    # ------------------------------------------------------------------ requests
    async def score(self, request: ScoreRequest) -> ScoreReply:
        rid = request.request_id
        digest = request.digest()
        known = self._answers.get(rid) or self._in_flight.get(rid)
        if known is not None:
            if known.digest != digest:
                raise ValueError(
                    f"request_id {rid!r} is already taken by another batch (sent with tokens of "
                    f"shape {tuple(request.tokens.shape)} that differ from the first). Use a fresh id "
                    "for every distinct batch (the client's default ids are)."
                )
            self._repeats += 1
            if isinstance(known, _Answer):
                return known.reply
            return await asyncio.shield(known.future)
        waiting = _Waiting(request, asyncio.get_running_loop().create_future(), digest)
        self._in_flight[rid] = waiting
        self._queue.append(waiting)
        if request.group is not None:
            self._arrived[request.group] = self._arrived.get(request.group, 0) + request.tokens.shape[0]
            self._arrived.move_to_end(request.group)
            while len(self._arrived) > _GROUPS_KEPT:
                self._arrived.popitem(last=False)
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        if self._batch_full():
            self._wake.set()
        return await asyncio.shield(waiting.future)

    def _batch_full(self) -> bool:
        first = self._queue[0].request if self._queue else None
        if (first is not None and first.group is not None and first.group_rows is not None
                and self._arrived.get(first.group, 0) >= first.group_rows):
            return True  # every row of its group is here: waiting longer gains nothing
        rows = sum(w.request.tokens.shape[0] for w in self._queue)
        longest = max((_row_length(w.request.mask) for w in self._queue), default=0)
        limits = self.limits
        return (limits.max_batch_rows is not None and rows >= limits.max_batch_rows) or (
            limits.max_batch_tokens is not None and rows * longest >= limits.max_batch_tokens
        )

    def _take(self) -> list[_Waiting]:
        """The oldest requests that fit the limits together (at least one, never split)."""
        taken: list[_Waiting] = []
        rows = longest = 0
        for waiting in self._queue:
            more = rows + waiting.request.tokens.shape[0]
            wider = max(longest, _row_length(waiting.request.mask))
            limits = self.limits
            over = (limits.max_batch_rows is not None and more > limits.max_batch_rows) or (
                limits.max_batch_tokens is not None and more * wider > limits.max_batch_tokens
            )
            if taken and over:
                break
            taken.append(waiting)
            rows, longest = more, wider
        del self._queue[: len(taken)]
        return taken

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            if not self._batch_full():
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=self.limits.max_wait_ms / 1000)
                except asyncio.TimeoutError:
                    pass
            self._wake.clear()
            batch = self._take()
            try:
                replies = await loop.run_in_executor(self._executor, self._forward, [w.request for w in batch])
            except Exception as exc:  # every caller of the failed batch gets the error
                for waiting in batch:
                    self._in_flight.pop(waiting.request.request_id, None)
                    waiting.future.set_exception(exc)
                continue
            for waiting, reply in zip(batch, replies):
                self._remember(_Answer(reply, waiting.digest))
                self._in_flight.pop(reply.request_id, None)
                waiting.future.set_result(reply)

    def _remember(self, answer: _Answer) -> None:
        self._answers[answer.reply.request_id] = answer
        while len(self._answers) > self.answer_cache:
            self._answers.popitem(last=False)

    def _forward(self, requests: list[ScoreRequest]) -> list[ScoreReply]:
        # Id order makes the packed grid, and so its float rounding, independent of arrival order.
        order = sorted(range(len(requests)), key=lambda i: requests[i].request_id)
        packed = pack_rows([(requests[i].tokens, requests[i].mask) for i in order])
        with torch.no_grad():
            log_probs = self.scorer.score(packed.ids, packed.mask).log_probs.to("cpu")
        self._forward_calls += 1
        self._requests += len(requests)
        self._rows += packed.ids.shape[0]
        parts = unpack_rows(log_probs, packed)
        replies: list[ScoreReply | None] = [None] * len(requests)
        for i, part in zip(order, parts):
            replies[i] = ScoreReply(requests[i].request_id, part, self._forward_calls, os.getpid(),
                                    self._weights_version)
        return replies

    # ------------------------------------------------------------------ control
    def forward_calls(self) -> int:
        return self._forward_calls

    def stats(self) -> ServiceStats:
        return ServiceStats(os.getpid(), self._forward_calls, self._requests, self._rows, self._repeats,
                            list(self._answers), [w.request.request_id for w in self._queue],
                            self._weights_version)

    def info(self) -> ServiceInfo:
        return ServiceInfo(_KIND, os.getpid(), self._weights_version)

    def flush(self) -> int:
        """Close the open batch now; returns how many requests were queued (0: nothing to do)."""
        # Only with requests queued: a wake left set would close the next batch at its first request.
        if self._queue:
            self._wake.set()
        return len(self._queue)

    async def load_weights(self, state: dict[str, Tensor], version: str | None = None) -> int:
        """Copy ``state`` into the reference between forward passes; returns the count copied."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._load, state, version)

    def _load(self, state: dict[str, Tensor], version: str | None) -> int:
        params = dict(self.scorer.model.named_parameters(remove_duplicate=False))
        unknown = sorted(set(state) - set(params))
        if unknown:
            raise KeyError(
                f"load_weights: {unknown[:5]} are not parameters of the service's reference "
                f"(it has e.g. {sorted(params)[:3]}). Send tensors named like the reference's parameters."
            )
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)
        self._weights_version = None if version is None else str(version)
        return len(state)


class ReferenceService:
    """Start (or find by name) the reference-model actor shared by several callers.

    Args:
        ref_model: scoring ``TransformersWrapper`` of the reference (shipped pickled; Ray keeps
            it to rebuild the actor after a restart).

    Keyword Args:
        ref_model_factory: callable returning that wrapper, called inside the actor, and again
            in each restarted actor. Exactly one of ``ref_model`` and ``ref_model_factory``.
        max_wait_ms: longest a batch stays open (from its first request, or from the end of the
            previous forward pass for requests that arrived during it).
        max_batch_rows, max_batch_tokens: close a batch as soon as it holds that many rows /
            ``rows * longest row`` tokens; a larger single request is scored alone, never split.
        num_cpus, num_gpus: Ray resources the actor holds.
        device: where the reference runs inside the actor; replies always come back on the CPU
            and the client moves them to the caller's device.
        actor_name: reuse the actor of that name if it exists, else create it under that name.
        max_restarts: how often Ray rebuilds a dead actor (-1: without limit).
        max_task_retries: how often Ray resubmits a call lost with a dead actor (-1: without limit).
        answer_cache: replies kept by request id to answer a resent request without rescoring
            (a resend comes within seconds, so a few per caller suffice).
        ready_timeout_s: longest the constructor waits for the actor to be placed and built.
    """

    def __init__(
        self,
        ref_model: TransformersWrapper | None = None,
        *,
        ref_model_factory: Callable[[], TransformersWrapper] | None = None,
        max_wait_ms: float = 5.0,
        max_batch_rows: int | None = None,
        max_batch_tokens: int | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        device: torch.device | str | None = None,
        actor_name: str | None = None,
        max_restarts: int = -1,
        max_task_retries: int = -1,
        answer_cache: int = 4096,
        ready_timeout_s: float = 300.0,
    ) -> None:
        require_ray(type(self).__name__)
        check_model_args(ref_model, ref_model_factory)
        limits = BatchLimits(max_wait_ms, max_batch_rows, max_batch_tokens)
        for name, value in (("max_restarts", max_restarts), ("max_task_retries", max_task_retries)):
            if isinstance(value, bool) or not isinstance(value, int) or value < -1:
                raise ValueError(f"{name}: expected an int >= -1 (-1: without limit), got {value!r}.")
        if isinstance(answer_cache, bool) or not isinstance(answer_cache, int) or answer_cache < 0:
            raise ValueError(f"answer_cache: expected an int >= 0, got {answer_cache!r}.")
        check_seconds("ready_timeout_s", ready_timeout_s)
        resources = actor_resources(num_cpus, num_gpus)
        target = remote_device(device, resources["num_gpus"])
        options = {**resources, "max_restarts": max_restarts, "max_task_retries": max_task_retries}
        lookup = get_or_create_actor(ReferenceServer, name=actor_name, options=options,
                                     args=(ref_model, ref_model_factory, limits, target, answer_cache))
        self.actor = lookup.handle
        self.actor_name = actor_name
        self.created_actor = lookup.created
        self.limits = limits
        self._closed = False
        try:
            info_method = lookup.handle.info
        except AttributeError:  # Ray's answer for a method the actor's class lacks
            raise TypeError(
                f"actor_name={actor_name!r}: that actor is not a {_KIND} (it has no info() method). "
                "Pick another actor_name for this service."
            ) from None
        # Fail here, not at the first request, when the model cannot be built or never gets placed.
        [info] = wait_ready([info_method.remote()], what=_KIND, timeout_s=ready_timeout_s, resources=resources,
                            on_timeout=self.shutdown if lookup.created else None)
        if not isinstance(info, ServiceInfo) or info.kind != _KIND:
            raise TypeError(
                f"actor_name={actor_name!r}: that actor is not a {_KIND} (its info() returned "
                f"{type(info).__name__}). Pick another actor_name for this service."
            )
        self.pid = info.pid

    def client(self, *, device: torch.device | str | None = None, max_attempts: int = 5,
               retry_delay_s: float = 0.5) -> ReferenceClient:
        """A picklable client of this service (see ``ReferenceClient``)."""
        return ReferenceClient(self.actor, device=device, max_attempts=max_attempts, retry_delay_s=retry_delay_s)

    def forward_calls(self) -> int:
        """Batched forward passes run by the current actor instance."""
        return ray.get(self.actor.forward_calls.remote())

    def stats(self) -> ServiceStats:
        """Counters and the ids in the answer cache and the queue (for tests and debugging)."""
        return ray.get(self.actor.stats.remote())

    def info(self) -> ServiceInfo:
        """The current instance's pid and weights version; cheap enough to ask every step."""
        return ray.get(self.actor.info.remote())

    def flush(self) -> int:
        """Close the open batch now rather than at its limits; returns the requests it held."""
        return ray.get(self.actor.flush.remote())

    def load_weights(self, state: dict[str, Tensor] | Any, version: str | None = None) -> int:
        """Copy named parameters (a dict of CPU tensors, or its ``ray.put`` ref) into the reference.

        ``version`` labels the weights: replies scored with them carry it, and ``info()``
        reports it. A restarted actor rebuilds the reference from its factory (version None):
        send the weights again then.
        """
        return ray.get(self.actor.load_weights.remote(state, version))

    def shutdown(self) -> None:
        """Kill the actor for good (no restart); later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        if ray.is_initialized():  # ray.kill without a connection would start a new local cluster
            ray.kill(self.actor, no_restart=True)

    def __repr__(self) -> str:
        return f"ReferenceService(actor_name={self.actor_name!r}, limits={self.limits})"
