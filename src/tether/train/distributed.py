"""``tether train --workers N``: the recipe's Ray set-up, built from its ``TrainConfig``.

Connects to Ray (starting a local cluster of ``max(2, N + 1)`` CPUs bound to 127.0.0.1 with
``tether.ray.start_local_cluster`` unless ``ray_address`` names one, or reusing the
connection of a caller that already initialised Ray), starts one ``ReferenceService`` and
``N`` rollout workers whose models come from the same ``build_models(cfg)`` as the
learner's. ``RolloutPool.shutdown()`` stops them (and disconnects from a cluster this module
connected to); a set-up that fails half-way stops what it started. The actors split the
CPUs the cluster has free evenly, so the service and every worker fit at once.

Each worker's request names the step's group of rows, so the service scores the whole step
in one packed batch the moment the last worker's rows arrive: the same batch on every run.
``max_wait_ms`` is only a backstop for rows that never come; a service restarted mid-step
is flushed by the pool instead of waiting it out. ``ray_timeout`` bounds every wait on Ray:
connecting to ``ray_address``, the actors coming up, each step's shards and answers.
"""

from __future__ import annotations

import functools
import math

import ray
import torch

from tether.models import TransformersWrapper
from tether.ray import (
    ReferenceService,
    RolloutPool,
    SamplingSettings,
    WorkerModel,
    connect_cluster,
    start_local_cluster,
)
from tether.train.config import TrainConfig
from tether.train.run import build_models, reference_scorer

__all__ = ["service_scorer", "start_workers", "worker_policy"]

_BACKSTOP_WAIT_MS = 60_000.0
_ANSWERS_PER_WORKER = 4  # a resend comes within seconds of its request: a few steps' worth is plenty


def worker_policy(cfg: TrainConfig) -> WorkerModel:
    """The policy a worker samples with: built like the learner's, weights pushed each step."""
    models = build_models(cfg)
    return WorkerModel(models.policy, models.tokenizer)


def service_scorer(cfg: TrainConfig) -> TransformersWrapper:
    """The learner's reference scorer, rebuilt inside the service actor."""
    if cfg.threads:  # the service's process gets the same torch threading as the learner's
        torch.set_num_threads(cfg.threads)
    return reference_scorer(build_models(cfg), cfg)


def _connect(cfg: TrainConfig) -> bool:
    """Connect to Ray; True when this call did (so the run disconnects at the end)."""
    if ray.is_initialized():
        return False
    if cfg.ray_address:
        connect_cluster(cfg.ray_address, cfg.ray_timeout)
    else:
        start_local_cluster(max(2, cfg.workers + 1))
    return True


def _cpu_share(actors: int) -> float:
    """Equal CPU reservation per actor, at most 1, rounded down so all of them fit in the free CPUs."""
    free = float(ray.available_resources().get("CPU", 0.0))
    share = min(1.0, math.floor(100 * free / actors) / 100)
    if share <= 0:
        raise ValueError(
            f"workers={actors - 1}: the Ray cluster has {free} CPUs free, too few for {actors} actors "
            "(the reference service and each worker). Use fewer workers, free the cluster's CPUs, "
            "or use a larger cluster."
        )
    return share


def start_workers(cfg: TrainConfig) -> RolloutPool:
    """The reference service and ``cfg.workers`` rollout workers, ready to sample."""
    owns_ray = _connect(cfg)
    service = None
    try:
        share = _cpu_share(cfg.workers + 1)
        service = ReferenceService(
            ref_model_factory=functools.partial(service_scorer, cfg), num_cpus=share,
            max_wait_ms=_BACKSTOP_WAIT_MS, max_batch_rows=cfg.prompts_per_step * cfg.group_size,
            answer_cache=_ANSWERS_PER_WORKER * cfg.workers, ready_timeout_s=cfg.ray_timeout,
            timeout_s=cfg.ray_timeout,
        )
        settings = SamplingSettings(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                    threads=cfg.threads)
        return RolloutPool(num_workers=cfg.workers, policy_factory=functools.partial(worker_policy, cfg),
                           service=service, settings=settings, seed=cfg.seed, group_size=cfg.group_size,
                           num_cpus=share, owns_ray=owns_ray, ready_timeout_s=cfg.ray_timeout,
                           timeout_s=cfg.ray_timeout)
    except BaseException:
        if service is not None:
            service.shutdown()  # a no-op when the pool's own clean-up already did it
        if owns_ray:
            ray.shutdown()
        raise
