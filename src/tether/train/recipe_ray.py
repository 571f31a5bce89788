"""The GRPO recipe with rollouts on Ray workers (``tether train --workers N``), and their set-up.

The stages and the loop are those of ``recipe`` (``train``'s parameter: tether's recipe, or a
copy's module); only the rollout differs. A copy (``tether cp recipe_ray``) runs as ``python
FILE --workers N [tether train flags]``. ``N`` workers sample whole groups with the learner's
current weights and score the reference log-probs through one shared ``ReferenceService`` while
they are at it, so the reference stage finds ``StepRecord.ref_log_probs`` filled and leaves it. The service returns log-probs only, so these
runs measure the leash by the sampled KL (``kl_signal`` in the metrics says so). The workers are
stopped when the run ends, also when a step raised: the actors hold the cluster's CPUs.

With a sharded learner (``--nproc N``), rank 0 alone connects to Ray and owns the pool: it sends
the whole step's groups to the workers with the weights every rank has gathered for the step,
and hands each rank its block of rows (the block that rank would have sampled itself), so the
update is the one-process update on the same rollout. A failure on rank 0 (starting the pool, a
rollout) is told to the other ranks, which raise instead of waiting for rows that will not come.
``start_workers`` connects to Ray, starts the service and the workers, whose models come from
the same ``build_models(cfg)`` as the learner's, and ``ray_timeout`` bounds every wait on Ray.
"""

from __future__ import annotations

import functools
import math
import warnings
from types import ModuleType
from typing import Any

import ray
import torch

from tether.models import TransformersWrapper
from tether.models.records import StepRecord, group_ids
from tether.ray import (
    ReferenceService,
    RolloutPool,
    SamplingSettings,
    WorkerModel,
    connect_cluster,
    start_local_cluster,
)
from tether.train import recipe as shipped
from tether.train import train_command
from tether.train.config import TrainConfig
from tether.train.recipe_sharded import sharded_rollout, writer_rollout
from tether.train.run_files import describe_checkpoints
from tether.train.run import Rollout, Run, build_models, build_run, reference_scorer
from tether.train.run_state import RunStopped
from tether.train.tasks import Problem, ToolUse


class SampledKLNote(UserWarning):
    """A Ray run reads the sampled KL where kl_signal asked for the exact one."""


def ray_rollout(pool: Any) -> Rollout:
    """The rollout stage over a ``tether.ray.RolloutPool`` (held by rank 0 of a sharded learner)."""

    def on_pool(run: Run, problems: list[Problem], step: int) -> StepRecord:
        try:
            td = pool.rollout(run.models.policy, [p.chat for p in problems], step, reference_updater=run.ref_updater)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as exc:
            # a dead worker (max_restarts=0) would sample its share with another seed if retried: stop instead
            said = " ".join(str(exc).split())[:200]
            raise RunStopped(f"step {step + 1}: a Ray rollout worker died ({type(exc).__name__}: {said}); the run "
                             f"stopped before the step's update. {describe_checkpoints(run.dir)}") from None
        return StepRecord.from_tensordict(td, group_ids=group_ids(len(problems), run.cfg.group_size))

    return writer_rollout(on_pool)


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True,
          recipe: ModuleType = shipped) -> dict[str, Any]:
    """``recipe.train`` (tether's recipe, or a copy's module) with the rollout on ``cfg.workers`` Ray workers."""
    if cfg.kl_signal == "exact":
        warnings.warn("kl_signal=exact: the Ray ReferenceService returns log-probs only, so this run's leash and "
                      "kl_bound read the sampled KL (the metrics' kl_signal says so).", SampledKLNote, stacklevel=2)
    run = build_run(cfg, fresh=not resume)
    pool = run.ranks.on_writer(lambda: start_workers(cfg, run.task.tool_use))  # rank 0's; None on the others
    rollout = ray_rollout(pool)
    if run.ranks.size > 1:  # rank 0 reads the whole policy to push it to the workers
        rollout = sharded_rollout(rollout, recipe.add_reference)
    try:
        return recipe.train(cfg, resume=resume, progress=progress, rollout=rollout, run=run)
    finally:
        if pool is not None:
            pool.shutdown()


def main(argv: list[str] | None = None) -> int:
    """``python recipe_ray.py --workers N [tether train flags]``: a copy runs like ``tether train --workers N``."""
    return train_command.main(argv, train_fn=train, ray_workers=True)


# ------------------------------------------------------------------------------ the Ray services
# Without ``ray_address`` (and without a caller that already initialised Ray, whose connection is
# reused) the run starts a local cluster of ``max(2, N + 1)`` CPUs bound to 127.0.0.1
# (``tether.ray.start_local_cluster``). ``RolloutPool.shutdown()`` stops the actors and disconnects
# from a cluster the run connected to; a set-up that fails half-way stops what it started. The
# actors split the CPUs the cluster has free evenly, so the service and every worker fit at once.
# Each worker's request names the step's group of rows, so the service scores the whole step in one
# packed batch the moment the last worker's rows arrive: the same batch on every run. ``max_wait_ms``
# is only a backstop for rows that never come; a service restarted mid-step is flushed by the pool.
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


def start_workers(cfg: TrainConfig, tool_use: ToolUse | None = None) -> RolloutPool:
    """The reference service and ``cfg.workers`` rollout workers, ready to sample (multi-turn
    episodes with the task's tools when it has ``tool_use``)."""
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
        tools = {} if tool_use is None else dict(tools=tool_use.tools, max_turns=tool_use.max_turns,
                                                 max_tokens=tool_use.max_tokens)
        settings = SamplingSettings(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                    threads=cfg.threads, **tools)
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


if __name__ == "__main__":
    raise SystemExit(main())
