"""The GRPO recipe on a sharded learner: ``tether train --nproc N``, one process per rank.

The stages and the loop are the recipe's (a copied recipe's when it is the one launched);
only the rollout is wrapped, as ``tether.train.recipe_ray`` wraps it for Ray. FSDP2 keeps
each rank's share of the weights (``tether.train.sharding``); the step's no-grad passes,
sampling and the reference, run inside ``Ranks.unsharded()``, which gathers every unit's
weights once, so no FSDP collective depends on how many decode steps or scoring passes a
rank needs. The reference's kept hidden states get their own copy of the head weight before
the gathered weights are freed. What stays in the recipe is data-parallel, not FSDP: each
rank's block of the problems (``Ranks.share``) and the whole-batch sums and rows
(``Ranks.total``, ``Ranks.rows``), identities in one process.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

from tether.models.step_record import StepRecord
from tether.train import recipe as shipped
from tether.train.config import TrainConfig
from tether.train.run import Run
from tether.train.tasks import Problem

Rollout = shipped.Rollout


def sharded_rollout(rollout: Rollout, add_reference: Callable[[Run, StepRecord], None]) -> Rollout:
    """``rollout`` then ``add_reference`` with every FSDP unit's weights gathered (all ranks together)."""

    def on_rank(run: Run, problems: list[Problem], step: int) -> StepRecord:
        with run.ranks.unsharded():
            record = rollout(run, problems, step)
            add_reference(run, record)
            record.ref_hidden = run.ranks.own(record.ref_hidden)
        return record

    return on_rank


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True,
          recipe: ModuleType = shipped) -> dict[str, Any]:
    """``recipe.train`` (tether's recipe, or a copy's module) on this rank, with the recipe's
    rollout, ``sample``, wrapped by ``sharded_rollout``."""
    return recipe.train(cfg, resume=resume, progress=progress,
                        rollout=sharded_rollout(recipe.sample, recipe.add_reference))
