"""``ReferenceClient``: send ``(tokens, mask)`` to a ``ReferenceService`` and get log-probs back.

Every request carries an id. The client resends a request under the same id when the
service actor died or was unreachable (on top of Ray's own task retries), and the service
answers an id it has already answered from its cache and joins a repeat of an id it is still
scoring, so a retried request is scored at most once per service instance and answered
exactly once to its caller. A request may also name its ``group`` (the requests one step
sends together) and the group's total rows, so the service can close the batch the moment
the last of them arrives. Each reply says which weights scored it (``weights_version``),
so a caller that pushed moved weights can tell an answer from a restarted service that has
only its factory's. The client is a small picklable object: hand it to rollout workers and
they all share the one service.
"""

from __future__ import annotations

import hashlib
import itertools
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from ray.exceptions import RayActorError
from torch import Tensor

from tether.ops.checks import real_number, whole_number
from tether.ray._checks import check_batch, check_group
from tether.ray._runtime import check_seconds, get_within, needs_ray

__all__ = ["PendingScore", "ReferenceClient", "ScoreReply", "ScoreRequest"]

_SLOW_SERVICE = (
    "The service may be busy with large batches, waiting out max_wait_ms for rows that never "
    "come, or stuck; check its logs, or raise the client's timeout_s "
    "(ReferenceService(timeout_s=...) or service.client(timeout_s=...); tether train: ray_timeout)."
)


@dataclass(frozen=True)
class ScoreRequest:
    """Token ids ``long [B, T]`` and their mask ``bool [B, T]`` (any padding side), on the CPU.

    ``group`` / ``group_rows``: the set of requests this one is sent with and their total
    rows; the service closes a batch once all of the group's rows have arrived instead of
    waiting for ``max_wait_ms``. Both or neither.
    """

    request_id: str
    tokens: Tensor
    mask: Tensor
    group: str | None = None
    group_rows: int | None = None

    def digest(self) -> str:
        """Fingerprint of the batch, to tell a resent request from an id reused for other tokens."""
        h = hashlib.blake2b(digest_size=16)
        h.update(repr(tuple(self.tokens.shape)).encode())
        h.update(self.tokens.contiguous().numpy().tobytes())
        h.update(self.mask.contiguous().numpy().tobytes())
        return h.hexdigest()


@dataclass(frozen=True)
class ScoreReply:
    """Reference log-probs ``[B, T]`` aligned with the request's tokens (0 where not scored).

    ``forward_index`` numbers the batched forward pass (within one service instance) that
    scored the request; ``service_pid`` identifies that instance; ``weights_version`` is the
    version given with the last ``load_weights`` of that instance (None: the weights it was
    built with).
    """

    request_id: str
    log_probs: Tensor
    forward_index: int
    service_pid: int
    weights_version: str | None = None


class PendingScore:
    """A request in flight; ``result()`` waits for it, resending on a dead service."""

    def __init__(self, client: ReferenceClient, request: ScoreRequest, device: torch.device) -> None:
        self.client = client
        self.request = request
        self.device = device
        self.attempts = 1
        self._ref = client.send(request)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @needs_ray
    def reply(self, timeout_s: float | None = None) -> ScoreReply:
        """The service's reply (log-probs on the CPU); raises after ``max_attempts`` failures.

        Each attempt waits at most ``timeout_s`` (default: the client's ``timeout_s``).
        """
        timeout = self.client.timeout_s if timeout_s is None else check_seconds("timeout_s", timeout_s)
        while True:
            try:
                reply = get_within(self._ref, what=f"request {self.request_id!r} to the reference service",
                                   timeout_s=timeout, fix=_SLOW_SERVICE)
                break
            except RayActorError as exc:  # died, restarting or unreachable: same id again
                if self.attempts >= self.client.max_attempts:
                    raise RuntimeError(
                        f"request {self.request_id!r}: the reference service failed {self.attempts} "
                        f"times ({type(exc).__name__}). Check the service's logs, or raise "
                        "max_attempts / the service's max_restarts."
                    ) from exc
                time.sleep(self.client.retry_delay_s * self.attempts)
                self.attempts += 1
                self._ref = self.client.send(self.request)
        if reply.request_id != self.request_id:
            raise RuntimeError(
                f"request {self.request_id!r} was answered with the reply of {reply.request_id!r}; "
                "the service routed rows to the wrong caller."
            )
        return reply

    def result(self, timeout_s: float | None = None) -> Tensor:
        """Reference log-probs ``[B, T]`` on the caller's device."""
        return self.reply(timeout_s).log_probs.to(self.device)


class ReferenceClient:
    """Caller side of a ``ReferenceService`` (get one with ``ReferenceService.client()``).

    Args:
        actor: the service's Ray actor handle.

    Keyword Args:
        device: where results are returned; default the device of the tokens sent.
        max_attempts: sends of one request before giving up (>= 1).
        retry_delay_s: pause before the first resend, growing linearly with each attempt.
        timeout_s: longest wait for one reply (per attempt) before a ``TimeoutError``.
    """

    def __init__(self, actor: Any, *, device: torch.device | str | None = None, max_attempts: int = 5,
                 retry_delay_s: float = 0.5, timeout_s: float = 600.0) -> None:
        whole_number("max_attempts", max_attempts, low=1)
        real_number("retry_delay_s", retry_delay_s, low=0)
        self.actor = actor
        self.device = torch.device(device) if device is not None else None
        self.max_attempts = max_attempts
        self.retry_delay_s = float(retry_delay_s)
        self.timeout_s = check_seconds("timeout_s", timeout_s)
        self._prefix = uuid.uuid4().hex[:12]
        self._counter = itertools.count()

    def __getstate__(self) -> dict[str, Any]:
        # A copy unpickled in another process must not reuse this client's ids.
        state = dict(self.__dict__)
        del state["_prefix"], state["_counter"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._prefix = uuid.uuid4().hex[:12]
        self._counter = itertools.count()

    def new_request_id(self) -> str:
        return f"{self._prefix}-{next(self._counter):08d}"

    @needs_ray
    def send(self, request: ScoreRequest) -> Any:
        """Submit one request to the actor; returns the Ray object ref of its reply."""
        return self.actor.score.remote(request)

    @needs_ray
    def submit(self, tokens: Tensor, mask: Tensor, *, request_id: str | None = None, group: str | None = None,
               group_rows: int | None = None) -> PendingScore:
        """Send ``tokens [B, T]`` / ``mask bool [B, T]`` now; the result is collected later.

        ``request_id`` defaults to a fresh id; the service concatenates the requests of one
        batched forward in id order, so ids that sort by (step, worker) make the batch's
        composition, and hence its float rounding, reproducible. ``group`` / ``group_rows``:
        see ``ScoreRequest``.
        """
        mask = check_batch(tokens, mask)
        check_group(group, group_rows, tokens.shape[0])
        device = self.device or tokens.device
        rid = self.new_request_id() if request_id is None else str(request_id)
        request = ScoreRequest(rid, tokens.detach().to("cpu").long(), mask.detach().to("cpu"),
                               None if group is None else str(group), group_rows)
        return PendingScore(self, request, device)

    @needs_ray
    def score(self, tokens: Tensor, mask: Tensor, *, request_id: str | None = None, group: str | None = None,
              group_rows: int | None = None) -> Tensor:
        """Reference log-probs ``[B, T]`` of ``tokens`` on the caller's device (blocking)."""
        return self.submit(tokens, mask, request_id=request_id, group=group, group_rows=group_rows).result()
