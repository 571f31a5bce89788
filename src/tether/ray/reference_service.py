"""``ReferenceService``: one Ray actor holding the reference model, batching its callers' requests.

Rollout workers send ``(tokens, mask)`` through a ``ReferenceClient``; the actor
(``reference_server.ReferenceServer``) checks each request on arrival, so a bad one fails
alone, and scores the others in batched forward passes (see that module for when a batch
closes). ``forward_calls()`` counts those passes. Every wait of this front object on the
actor is bounded by ``ready_timeout_s`` (construction) or ``timeout_s``, and every method that
talks to Ray raises ``RayNotInitializedError`` once Ray is shut down instead of starting a
new cluster.

Fault tolerance: the actor is created with ``max_restarts`` and ``max_task_retries``, so
when it dies Ray builds a new one from the same arguments (``ref_model_factory`` rebuilds the
model there) and resubmits the calls that were in flight; ``ReferenceClient`` resends under
the same request id if an error still surfaces. Answers are cached by request id, so a
repeated id is never scored twice by one instance, and each caller receives one answer. A
rebuilt actor has its factory's weights again (``weights_version`` None in its replies and
``info()``): weights loaded since must be sent again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from tether.models import TransformersWrapper
from tether.ops.checks import whole_number
from tether.ray._checks import check_model_args
from tether.ray._runtime import (
    actor_resources,
    check_seconds,
    get_or_create_actor,
    get_within,
    kill_if_connected,
    needs_ray,
    remote_device,
    require_ray,
    wait_ready,
)
from tether.ray.reference_client import ReferenceClient
from tether.ray.reference_server import KIND, BatchLimits, ReferenceServer, ServiceInfo, ServiceStats

__all__ = ["BatchLimits", "ReferenceServer", "ReferenceService", "ServiceInfo", "ServiceStats"]


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
        timeout_s: longest wait for any later answer of the actor (``stats``, ``load_weights``,
            ...), and the default of its clients' wait for one reply.

    Examples:
        >>> import torch
        >>> from tether.llm import chat_batch
        >>> from tether.models import TransformersWrapper
        >>> from tether.models.tiny import byte_tokenizer, tiny_causal_lm
        >>> tok = byte_tokenizer()
        >>> ref = TransformersWrapper(tiny_causal_lm(tok, seed=1), tok, input_mode="tokens", generate=False,
        ...                           log_probs_key="ref_log_probs")
        >>> policy = TransformersWrapper(tiny_causal_lm(tok, seed=0), tok, generate=False)
        >>> batch = policy(chat_batch([[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]]))
        >>> # With a cluster running: tether.ray.start_local_cluster(2), or ray.init(address=...).
        >>> service = ReferenceService(ref, max_wait_ms=5)
        >>> client = service.client()  # picklable: hand it to rollout workers
        >>> tokens, mask = batch["tokens", "full"], batch["masks", "all_attention_mask"]
        >>> torch.equal(client.score(tokens, mask), ref.score(tokens, mask).log_probs)  # one shared forward pass
        True
        >>> service.shutdown()
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
        timeout_s: float = 600.0,
    ) -> None:
        require_ray(type(self).__name__)
        check_model_args(ref_model, ref_model_factory)
        limits = BatchLimits(max_wait_ms, max_batch_rows, max_batch_tokens)
        for name, value in (("max_restarts", max_restarts), ("max_task_retries", max_task_retries)):
            whole_number(name, value, low=-1, fix="-1 means without limit.")
        whole_number("answer_cache", answer_cache, low=0)
        check_seconds("ready_timeout_s", ready_timeout_s)
        self.timeout_s = check_seconds("timeout_s", timeout_s)
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
                f"actor_name={actor_name!r}: that actor is not a {KIND} (it has no info() method). "
                "Pick another actor_name for this service."
            ) from None
        # Fail here, not at the first request, when the model cannot be built or never gets placed.
        [info] = wait_ready([info_method.remote()], what=KIND, timeout_s=ready_timeout_s, resources=resources,
                            on_timeout=self.shutdown if lookup.created else None)
        if not isinstance(info, ServiceInfo) or info.kind != KIND:
            raise TypeError(
                f"actor_name={actor_name!r}: that actor is not a {KIND} (its info() returned "
                f"{type(info).__name__}). Pick another actor_name for this service."
            )
        self.pid = info.pid

    def client(self, *, device: torch.device | str | None = None, max_attempts: int = 5,
               retry_delay_s: float = 0.5, timeout_s: float | None = None) -> ReferenceClient:
        """A picklable client of this service (see ``ReferenceClient``); ``timeout_s`` defaults to the service's."""
        return ReferenceClient(self.actor, device=device, max_attempts=max_attempts, retry_delay_s=retry_delay_s,
                               timeout_s=self.timeout_s if timeout_s is None else timeout_s)

    def _call(self, method: str, *args: Any) -> Any:
        """The actor's answer to ``method(*args)``, waited for at most ``timeout_s``."""
        ref = getattr(self.actor, method).remote(*args)
        return get_within(ref, what=f"{KIND}.{method}", timeout_s=self.timeout_s,
                          fix="The actor may be busy with a long forward pass or stuck; check its logs, "
                              "or raise timeout_s (tether train: ray_timeout).")

    @needs_ray
    def forward_calls(self) -> int:
        """Batched forward passes run by the current actor instance."""
        return self._call("forward_calls")

    @needs_ray
    def stats(self) -> ServiceStats:
        """Counters and the ids in the answer cache and the queue (for tests and debugging)."""
        return self._call("stats")

    @needs_ray
    def info(self) -> ServiceInfo:
        """The current instance's pid and weights version; cheap enough to ask every step."""
        return self._call("info")

    @needs_ray
    def flush(self) -> int:
        """Close the open batch now rather than at its limits; returns the requests it held."""
        return self._call("flush")

    @needs_ray
    def load_weights(self, state: dict[str, Tensor] | Any, version: str | None = None) -> int:
        """Copy named parameters (a dict of CPU tensors, or its ``ray.put`` ref) into the reference.

        ``version`` labels the weights: replies scored with them carry it, and ``info()``
        reports it. A restarted actor rebuilds the reference from its factory (version None):
        send the weights again then.
        """
        return self._call("load_weights", state, version)

    def shutdown(self) -> None:
        """Kill the actor for good (no restart); later calls, and calls after ``ray.shutdown()``,
        do nothing (see ``kill_if_connected``)."""
        if not self._closed:
            self._closed = True
            kill_if_connected(self.actor)

    def __repr__(self) -> str:
        return f"ReferenceService(actor_name={self.actor_name!r}, limits={self.limits})"
