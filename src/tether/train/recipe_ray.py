"""The GRPO recipe with rollouts on Ray workers: ``tether train --workers N``.

The stages and the loop are ``tether.train.recipe``'s; only the rollout differs. ``N``
workers sample whole groups with the learner's current weights and score the reference
log-probs through one shared ``ReferenceService`` while they are at it, so the reference
stage finds ``StepRecord.ref_log_probs`` filled and leaves it. The service returns
log-probs only, so these runs measure the leash by the sampled KL (``kl_signal`` in the
metrics says so). The workers are stopped when the run ends, also when a step raised: the
actors hold the cluster's CPUs.
"""

from __future__ import annotations

import warnings
from typing import Any

from tether.models.step_record import StepRecord
from tether.train import recipe
from tether.train.config import TrainConfig
from tether.train.run import Run, build_run
from tether.train.run_dir import check_new_run_dir
from tether.train.tasks import Problem


def ray_rollout(pool: Any) -> recipe.Rollout:
    """The rollout stage over a ``tether.ray.RolloutPool``."""

    def rollout(run: Run, problems: list[Problem], step: int) -> StepRecord:
        td = pool.rollout(run.models.policy, [p.chat for p in problems], step, reference_updater=run.ref_updater)
        return StepRecord.from_tensordict(td, group_ids=recipe.group_ids(len(problems), run.cfg.group_size))

    return rollout


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """``tether.train.recipe.train`` with the rollout on ``cfg.workers`` Ray workers."""
    from tether.train.distributed import start_workers  # Ray is optional: imported only when asked for

    if not resume:
        check_new_run_dir(cfg.validate())
    if cfg.kl_signal == "exact":
        warnings.warn("kl_signal=exact: the Ray ReferenceService returns log-probs only, so this run's leash and "
                      "kl_bound read the sampled KL (the metrics' kl_signal says so).", stacklevel=2)
    run = build_run(cfg)
    pool = start_workers(cfg)
    try:
        return recipe.train(cfg, resume=resume, progress=progress, rollout=ray_rollout(pool), run=run)
    finally:
        pool.shutdown()
