"""The actor body of ``ReferenceService``: a queue of scoring requests, batched forward passes.

Rollout workers send ``(tokens, mask)`` through a ``ReferenceClient``. The actor (an asyncio
actor, so requests keep arriving while a forward pass runs) checks each request before it
joins a batch, so a request the forward pass would fail on (token ids past the reference's
vocabulary, malformed tensors) is refused alone and its batch-mates are answered. It queues
the others; a batch closes when the queued rows or tokens reach ``max_batch_rows`` /
``max_batch_tokens``, when every row of the oldest queued request's group has arrived (or was
refused), when a caller calls ``flush()``, or when ``max_wait_ms`` has passed since it opened
(at its first request, or at the end of the previous forward pass for requests that queued
meanwhile). The closed batch's rows, in request-id order, are packed into one right-padded
grid and scored by a single ``TransformersWrapper.score`` call; each caller gets its own rows
back in its own layout. ``load_weights`` runs on the same single thread as the forward passes,
so a batch is scored wholly with the old weights or wholly with the new ones. A batch whose
joint forward pass fails anyway is scored again request by request, so the failure reaches only
the requests that cause it.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from tether.llm._checks import vocab_size
from tether.llm.retrieve_kl import resolve_reference
from tether.models import TransformersWrapper
from tether.models.weights import load_named
from tether.ops.checks import real_number, whole_number
from tether.ray._checks import check_batch, check_group, check_token_range
from tether.ray._request_grid import join_requests, split_requests
from tether.ray._runtime import place_scorer
from tether.ray.reference_client import ScoreReply, ScoreRequest

__all__ = ["KIND", "BatchLimits", "ReferenceServer", "ServiceInfo", "ServiceStats"]

KIND = "ReferenceService"
_GROUPS_KEPT = 64  # groups whose arrived rows are counted; older ones are long closed


@dataclass(frozen=True)
class BatchLimits:
    """When a batch of requests closes. ``None`` removes a size limit."""

    max_wait_ms: float = 5.0
    max_batch_rows: int | None = None
    max_batch_tokens: int | None = None  # rows * longest row of the packed grid

    def __post_init__(self) -> None:
        real_number("max_wait_ms", self.max_wait_ms, low=0)
        for name in ("max_batch_rows", "max_batch_tokens"):
            if getattr(self, name) is not None:
                whole_number(name, getattr(self, name), low=1, fix="Pass None for no limit.")


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


def _input_vocab(scorer: TransformersWrapper) -> int | None:
    """How many token ids the reference can score: its embedding rows and its output head's."""
    embeddings = scorer.model.get_input_embeddings()
    sizes = [getattr(embeddings, "num_embeddings", None), vocab_size(scorer)]
    return min((n for n in sizes if n is not None), default=None)


def _row_length(mask: Tensor) -> int:
    return int(mask.sum(-1).max()) if mask.numel() else 0


class ReferenceServer:
    """Ray actor body of ``ReferenceService`` (see the module docstring)."""

    def __init__(self, ref_model: TransformersWrapper | None,
                 ref_model_factory: Callable[[], TransformersWrapper] | None, limits: BatchLimits,
                 device: torch.device | None, answer_cache: int) -> None:
        self.scorer = resolve_reference(ref_model, ref_model_factory)
        place_scorer(self.scorer, device)
        self.vocab = _input_vocab(self.scorer)
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
    def _check_form(self, request: Any) -> ScoreRequest:
        """``request``, a ``ScoreRequest`` whose tensors and group fields are well formed (else a typed
        error), with its mask as bool (a hand-built request may carry a 0/1 integer mask)."""
        if not isinstance(request, ScoreRequest) or not isinstance(request.request_id, str):
            raise TypeError(
                f"request: expected a tether.ray.ScoreRequest with a str request_id, got "
                f"{type(request).__name__}. Send requests through ReferenceClient.submit."
            )
        mask = check_batch(request.tokens, request.mask)
        check_group(request.group, request.group_rows, request.tokens.shape[0])
        return request if mask is request.mask else replace(request, mask=mask)

    def _count_arrival(self, group: str, rows: int) -> None:
        self._arrived[group] = self._arrived.get(group, 0) + rows
        self._arrived.move_to_end(group)
        while len(self._arrived) > _GROUPS_KEPT:
            self._arrived.popitem(last=False)

    async def score(self, request: ScoreRequest) -> ScoreReply:
        # Checked before the request joins a batch: a request the forward pass would choke on
        # (ids past the vocabulary, a float mask) fails alone, and its batch-mates are answered.
        request = self._check_form(request)
        try:
            check_token_range(request.tokens, request.mask, self.vocab, f"request {request.request_id!r}")
        except ValueError:
            if request.group is not None:  # its rows never come: count them, so the group still closes
                self._count_arrival(request.group, request.tokens.shape[0])
                if self._batch_full():
                    self._wake.set()
            raise
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
            self._count_arrival(request.group, request.tokens.shape[0])
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
            outcomes = await self._score_batch(loop, [w.request for w in batch])
            for waiting, outcome in zip(batch, outcomes):
                self._in_flight.pop(waiting.request.request_id, None)
                if isinstance(outcome, Exception):
                    waiting.future.set_exception(outcome)
                else:
                    self._remember(_Answer(outcome, waiting.digest))
                    waiting.future.set_result(outcome)

    async def _score_batch(self, loop: asyncio.AbstractEventLoop,
                           requests: list[ScoreRequest]) -> list[ScoreReply | Exception]:
        """Each request's reply, or the error that stopped it.

        When the joint forward pass fails, every request is scored again on its own: a failure
        the arrival checks cannot foresee (too long for the model, say) reaches only the
        requests that cause it.
        """
        try:
            return await loop.run_in_executor(self._executor, self._forward, requests)
        except Exception as exc:
            if len(requests) == 1:
                return [exc]
        outcomes: list[ScoreReply | Exception] = []
        for request in requests:
            try:
                outcomes.extend(await loop.run_in_executor(self._executor, self._forward, [request]))
            except Exception as exc:
                outcomes.append(exc)
        return outcomes

    def _remember(self, answer: _Answer) -> None:
        self._answers[answer.reply.request_id] = answer
        while len(self._answers) > self.answer_cache:
            self._answers.popitem(last=False)

    def _forward(self, requests: list[ScoreRequest]) -> list[ScoreReply]:
        # Id order makes the packed grid, and so its float rounding, independent of arrival order.
        order = sorted(range(len(requests)), key=lambda i: requests[i].request_id)
        packed = join_requests([(requests[i].tokens, requests[i].mask) for i in order])
        with torch.no_grad():
            log_probs = self.scorer.score(packed.ids, packed.mask).log_probs.to("cpu")
        self._forward_calls += 1
        self._requests += len(requests)
        self._rows += packed.ids.shape[0]
        parts = split_requests(log_probs, packed)
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
        return ServiceInfo(KIND, os.getpid(), self._weights_version)

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
        load_named(self.scorer.model, state, owner="the service's reference",
                   fix="Send tensors named like the reference's parameters.")
        self._weights_version = None if version is None else str(version)
        return len(state)
