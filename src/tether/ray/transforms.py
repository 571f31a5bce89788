"""``RayKLRewardTransform`` and ``RayRetrieveKL``: tether's LLM KL transforms hosted in a Ray actor.

The actor builds the local transform (``tether.llm.KLRewardTransform`` / ``RetrieveKL``) and
holds the reference model; the caller keeps a thin TensorDict module whose results are those
of the local transform, written on the caller's device. ``ref_model_factory`` runs inside the
actor (no weights travel); callers naming the same ``actor_name`` share one actor. Ray must be
initialised first (``RayNotInitializedError``); every wait is bounded (``ready_timeout_s``,
``timeout_s``).

Departures from TorchRL: separate classes, not a metaclass swap; construction waits
for the actor, so a failing factory is reported where the transform is built; unknown keywords
are refused locally; ``detach=False`` is refused (a graph cannot cross processes); ``kl_coef``
reads and writes the shared actor's coefficient.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from tether.llm import KLRewardTransform, RetrieveKL
from tether.llm.retrieve_kl import resolve_reference
from tether.models import TransformersWrapper
from tether.ray._checks import check_model_args
from tether.ray._runtime import (
    actor_resources,
    caller_device,
    check_seconds,
    get_or_create_actor,
    get_within,
    kill_if_connected,
    needs_ray,
    place_scorer,
    remote_device,
    require_ray,
    wait_ready,
)

__all__ = ["RayKLRewardTransform", "RayRetrieveKL", "TransformHostInfo"]

# Arguments the Ray classes take themselves instead of forwarding to the local transform.
_OWN_ARGS = {"self", "gen_model", "ref_model", "ref_model_factory", "device"}


@dataclass(frozen=True)
class ModelSpec:
    """How the actor obtains its models: built objects or factories called in the actor."""

    ref_model: TransformersWrapper | None = None
    ref_model_factory: Callable[[], TransformersWrapper] | None = None
    gen_model: TransformersWrapper | None = None
    gen_model_factory: Callable[[], TransformersWrapper] | None = None


@dataclass(frozen=True)
class TransformHostInfo:
    """What a transform actor hosts; used to check a reused named actor fits the caller."""

    kind: str
    actor_id: str
    pid: int
    in_keys: list
    out_keys: list


def _build_kl_reward(spec: ModelSpec, kwargs: dict[str, Any], device: torch.device | None) -> TensorDictModuleBase:
    reference = resolve_reference(spec.ref_model, spec.ref_model_factory)
    place_scorer(reference, device)
    return KLRewardTransform(reference, device=device, **kwargs)


def _build_retrieve_kl(spec: ModelSpec, kwargs: dict[str, Any], device: torch.device | None) -> TensorDictModuleBase:
    reference = resolve_reference(spec.ref_model, spec.ref_model_factory)
    policy = spec.gen_model_factory() if spec.gen_model_factory is not None else spec.gen_model
    place_scorer(reference, device)
    place_scorer(policy, device)
    return RetrieveKL(policy, reference, device=device, **kwargs)


class TransformHost:
    """Ray actor body: one local KL transform, applied to the batches callers send."""

    def __init__(self, kind: str, build: Callable[..., TensorDictModuleBase], spec: ModelSpec,
                 kwargs: dict[str, Any], device: torch.device | None) -> None:
        self.kind = kind
        self.device = device
        self.module = build(spec, kwargs, device)

    def describe(self) -> TransformHostInfo:
        return TransformHostInfo(self.kind, ray.get_runtime_context().get_actor_id(), os.getpid(),
                                 list(self.module.in_keys), list(self.module.out_keys))

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        if self.device is not None:
            td = td.to(self.device)
        out = self.module(td)
        # Results travel back through Ray's object store, which wants CPU tensors.
        return out.to("cpu") if self.device is not None else out

    def get_kl_coef(self) -> float:
        return self.module.kl_coef

    def set_kl_coef(self, value: float) -> float:
        self.module.kl_coef = value
        return self.module.kl_coef


def _check_kwargs(local: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    valid = sorted(set(inspect.signature(local.__init__).parameters) - _OWN_ARGS)
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise TypeError(
            f"{unknown}: not keyword arguments of {local.__name__}. Valid keywords besides the "
            f"Ray ones (num_cpus, num_gpus, device, actor_name, ready_timeout_s, timeout_s): {valid}."
        )
    if kwargs.get("detach", True) is False:
        raise ValueError(
            "detach=False: an autograd graph cannot come back from a Ray actor. Use the local "
            "tether.llm transform when the KL must stay differentiable."
        )
    return kwargs


class _RayTransform(TensorDictModuleBase):
    """Shared body of the Ray KL transforms: actor set-up, remote calls, coefficient."""

    kind: str = ""

    def _start(self, build: Callable[..., TensorDictModuleBase], spec: ModelSpec, kwargs: dict[str, Any], *,
               num_cpus: float, num_gpus: float, device: Any, actor_name: str | None, ready_timeout_s: float,
               timeout_s: float) -> None:
        require_ray(type(self).__name__)
        check_seconds("ready_timeout_s", ready_timeout_s)
        self.timeout_s = check_seconds("timeout_s", timeout_s)
        options = actor_resources(num_cpus, num_gpus)
        target = remote_device(device, options["num_gpus"])
        lookup = get_or_create_actor(TransformHost, name=actor_name, options=options,
                                     args=(self.kind, build, spec, kwargs, target))
        try:
            describe = lookup.handle.describe
        except AttributeError:  # a named actor of another class, e.g. a ReferenceService
            raise TypeError(
                f"actor_name={actor_name!r}: that actor is not a transform host (it has no describe() "
                "method). Pick another actor_name for this transform."
            ) from None
        leftover = (lookup.handle,) if lookup.created else ()  # a shared actor found by name stays
        [info] = wait_ready([describe.remote()], what=type(self).__name__, timeout_s=ready_timeout_s,
                            resources=options, on_timeout=lambda: kill_if_connected(*leftover))
        if info.kind != self.kind:
            raise TypeError(
                f"actor_name={actor_name!r}: that actor hosts a {info.kind}, not a {self.kind}. "
                "Pick another actor_name for this transform."
            )
        self.actor = lookup.handle
        self.actor_name = actor_name
        self.created_actor = lookup.created
        self.info = info
        self.in_keys = list(info.in_keys)
        self.out_keys = list(info.out_keys)
        self._closed = False

    def _call(self, method: str, *args: Any) -> Any:
        """The actor's answer to ``method(*args)``, waited for at most ``timeout_s``."""
        return get_within(getattr(self.actor, method).remote(*args), what=f"{type(self).__name__}.{method}",
                          timeout_s=self.timeout_s,
                          fix="The actor may be busy with a large batch or stuck; check its logs, or raise "
                              "timeout_s.")

    @property
    def actor_id(self) -> str:
        """Ray id of the hosting actor (equal for every transform sharing an ``actor_name``)."""
        return self.info.actor_id

    @property
    @needs_ray
    def kl_coef(self) -> float:
        return self._call("get_kl_coef")

    @kl_coef.setter
    @needs_ray
    def kl_coef(self, value: float) -> None:
        self._call("set_kl_coef", value)

    @needs_ray
    def forward(self, td: TensorDictBase) -> TensorDictBase:
        device = caller_device(td)
        result = self._call("forward", td.to("cpu"))
        td.update(result.to(device))
        return td

    def shutdown(self) -> None:
        """Kill the hosting actor, for every transform sharing it; later calls, and calls
        after ``ray.shutdown()``, do nothing (see ``kill_if_connected``)."""
        if not self._closed:
            self._closed = True
            kill_if_connected(self.actor)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, actor_id={self.actor_id!r}, actor_name={self.actor_name!r}"


class RayKLRewardTransform(_RayTransform):
    """``tether.llm.KLRewardTransform`` hosted in a Ray actor; same inputs, outputs and errors.

    Args:
        ref_model: scoring ``TransformersWrapper`` of the frozen reference (shipped pickled).

    Keyword Args:
        ref_model_factory: callable returning that wrapper, called inside the actor (preferred:
            no weights travel). Exactly one of ``ref_model`` and ``ref_model_factory``.
        num_cpus, num_gpus: Ray resources the actor holds for its lifetime.
        device: device the reference runs on inside the actor (a CUDA device needs
            ``num_gpus``); results always come back on the caller's device.
        actor_name: reuse the actor of that name if it exists (its model and settings stay
            those it was built with), else create it under that name.
        ready_timeout_s: longest the constructor waits for the actor to be placed and built.
        timeout_s: longest wait for the actor's answer to each later call (a batch, ``kl_coef``).
        **kwargs: the other keywords of ``KLRewardTransform`` (``coef``, ``in_keys``,
            ``out_keys``, ``log_prob_key``, ``add_to_reward``, ``tokenizer``,
            ``assistant_only``, ``padding_side``).

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
        >>> batch["next", "reward"] = torch.tensor([[1.0]])
        >>> # With a cluster running: tether.ray.start_local_cluster(2), or ray.init(address=...).
        >>> from tether.llm import KLRewardTransform
        >>> remote = RayKLRewardTransform(ref_model=ref, coef=0.1)  # the reference runs in a Ray actor
        >>> out, local = remote(batch.clone()), KLRewardTransform(ref, coef=0.1)(batch.clone())
        >>> torch.equal(out["next", "reward"], local["next", "reward"])  # the in-process transform's values
        True
        >>> remote.shutdown()
    """

    kind = "KLRewardTransform"

    def __init__(
        self,
        ref_model: TransformersWrapper | None = None,
        *,
        ref_model_factory: Callable[[], TransformersWrapper] | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        device: torch.device | str | None = None,
        actor_name: str | None = None,
        ready_timeout_s: float = 300.0,
        timeout_s: float = 600.0,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        check_model_args(ref_model, ref_model_factory)
        spec = ModelSpec(ref_model=ref_model, ref_model_factory=ref_model_factory)
        self._start(_build_kl_reward, spec, _check_kwargs(KLRewardTransform, kwargs), num_cpus=num_cpus,
                    num_gpus=num_gpus, device=device, actor_name=actor_name,
                    ready_timeout_s=ready_timeout_s, timeout_s=timeout_s)

    coef = _RayTransform.kl_coef  # TorchRL's keyword


class RayRetrieveKL(_RayTransform):
    """``tether.llm.RetrieveKL`` hosted in a Ray actor; same inputs, outputs and errors.

    Args:
        gen_model: scoring wrapper of the policy, or None (default) to reuse the log-probs
            recorded at sampling time. The actor holds its own copy, frozen at construction:
            a policy that keeps training should leave this None.
        ref_model: scoring wrapper of the frozen reference (shipped pickled).

    Keyword Args:
        ref_model_factory, gen_model_factory: callables building those wrappers inside the
            actor. Exactly one of ``ref_model`` / ``ref_model_factory``; at most one of
            ``gen_model`` / ``gen_model_factory``.
        num_cpus, num_gpus, device, actor_name, ready_timeout_s, timeout_s: as for
            ``RayKLRewardTransform``.
        **kwargs: the other keywords of ``RetrieveKL`` (``assistant_only``, ``tokenizer``,
            ``tokenizer_kwargs``, ``padding_side``, key names, ``add_to_reward``, ``coeff``,
            ``estimator``); ``detach`` must stay True.

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
        >>> batch["next", "reward"] = torch.tensor([[1.0]])
        >>> # With a cluster running: tether.ray.start_local_cluster(2), or ray.init(address=...).
        >>> from tether.llm import RetrieveKL
        >>> remote = RayRetrieveKL(ref_model=ref, coeff=0.1)  # gen_model None: the batch's own log-probs
        >>> out, local = remote(batch.clone()), RetrieveKL(None, ref, coeff=0.1)(batch.clone())
        >>> torch.equal(out["next", "kl_penalty"], local["next", "kl_penalty"])
        True
        >>> remote.shutdown()
    """

    kind = "RetrieveKL"

    def __init__(
        self,
        gen_model: TransformersWrapper | None = None,
        ref_model: TransformersWrapper | None = None,
        *,
        ref_model_factory: Callable[[], TransformersWrapper] | None = None,
        gen_model_factory: Callable[[], TransformersWrapper] | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        device: torch.device | str | None = None,
        actor_name: str | None = None,
        ready_timeout_s: float = 300.0,
        timeout_s: float = 600.0,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        check_model_args(ref_model, ref_model_factory, gen_model, gen_model_factory)
        spec = ModelSpec(ref_model, ref_model_factory, gen_model, gen_model_factory)
        self._start(_build_retrieve_kl, spec, _check_kwargs(RetrieveKL, kwargs), num_cpus=num_cpus,
                    num_gpus=num_gpus, device=device, actor_name=actor_name,
                    ready_timeout_s=ready_timeout_s, timeout_s=timeout_s)

    coeff = _RayTransform.kl_coef  # TorchRL's keyword
