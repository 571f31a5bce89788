"""The GRPO recipe with rollouts on Ray workers: ``tether train --workers N``.

The stages and the loop are ``tether.train.recipe``'s; only the rollout differs. ``N``
workers sample whole groups with the learner's current weights and score the reference
log-probs through one shared ``ReferenceService`` while they are at it, so the reference
stage finds ``StepRecord.ref_log_probs`` filled and leaves it. The service returns
log-probs only, so these runs measure the leash by the sampled KL (``kl_signal`` in the
metrics says so). The workers are stopped when the run ends, also when a step raised: the
actors hold the cluster's CPUs.

With a sharded learner (``--nproc N``), rank 0 alone connects to Ray and owns the pool: it
sends the whole step's groups to the workers with the weights every rank has gathered for
the step, and hands each rank its block of rows (the block that rank would have sampled
itself), so the learner's update is the one-process update on the same rollout. A failure on
rank 0 (starting the pool, a rollout) is told to the other ranks, which raise instead of
waiting for rows that will not come.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

from tether.models.step_record import StepRecord, group_ids
from tether.train import recipe
from tether.train.config import TrainConfig
from tether.train.recipe_sharded import sharded_rollout
from tether.train.run import Run, build_run
from tether.train.tasks import Problem


class SampledKLNote(UserWarning):
    """A Ray run reads the sampled KL where kl_signal asked for the exact one."""


def ray_rollout(pool: Any) -> recipe.Rollout:
    """The rollout stage over a ``tether.ray.RolloutPool`` (held by rank 0 of a sharded learner)."""

    def on_pool(run: Run, problems: list[Problem], step: int) -> StepRecord:
        td = pool.rollout(run.models.policy, [p.chat for p in problems], step, reference_updater=run.ref_updater)
        return StepRecord.from_tensordict(td, group_ids=group_ids(len(problems), run.cfg.group_size))

    def rollout(run: Run, problems: list[Problem], step: int) -> StepRecord:
        ranks = run.ranks
        if ranks.size == 1:
            return on_pool(run, problems, step)

        def blocks() -> list[StepRecord]:
            whole = on_pool(run, recipe.step_problems(run, step, every_rank=True), step)
            rows = len(whole) // ranks.size
            parts = [whole.rows(r * rows, (r + 1) * rows) for r in range(ranks.size)]
            return [replace(p, group_ids=group_ids(rows, run.cfg.group_size)) for p in parts]

        return ranks.scatter(ranks.on_writer(blocks))

    return rollout


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """``tether.train.recipe.train`` with the rollout on ``cfg.workers`` Ray workers."""
    from tether.train.distributed import start_workers  # Ray is optional: imported only when asked for

    if cfg.kl_signal == "exact":
        warnings.warn("kl_signal=exact: the Ray ReferenceService returns log-probs only, so this run's leash and "
                      "kl_bound read the sampled KL (the metrics' kl_signal says so).", SampledKLNote, stacklevel=2)
    run = build_run(cfg, fresh=not resume)
    pool = run.ranks.on_writer(lambda: start_workers(cfg))  # rank 0's; None on the others
    rollout = ray_rollout(pool)
    if run.ranks.size > 1:  # rank 0 reads the whole policy to push it to the workers
        rollout = sharded_rollout(rollout, recipe.add_reference)
    try:
        return recipe.train(cfg, resume=resume, progress=progress, rollout=rollout, run=run)
    finally:
        if pool is not None:
            pool.shutdown()
