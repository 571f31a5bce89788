"""The GRPO recipe on a sharded learner: ``tether train --nproc N``, one process per rank.

The stages and the loop are the recipe's (a copied recipe's when it is the one launched);
only the rollout is wrapped, as ``tether.train.recipe_ray`` wraps it for Ray. FSDP2 keeps
each rank's share of the weights (``tether.train.sharding``); the step's no-grad passes,
sampling and the reference, run inside ``Ranks.unsharded()``, which gathers every unit's
weights once, so no FSDP collective depends on how many decode steps or scoring passes a
rank needs. The reference's kept hidden states get their own copy of the head weight before
the gathered weights are freed. What stays in the recipe is data-parallel, not FSDP: each
rank's block of the problems (``Ranks.share``) and the whole-batch sums and rows
(``Ranks.total``, ``Ranks.rows``), identities in one process. A rollout whose ranks cannot draw
together (Ray workers, the multi-turn tool task) runs on rank 0 for all (``writer_rollout``).
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import ModuleType
from typing import Any, Callable

from tether.models.records import StepRecord, group_ids
from tether.train.config import TrainConfig
from tether.train.run import Rollout, Run
from tether.train.tasks import Problem


def sharded_rollout(rollout: Rollout, add_reference: Callable[[Run, StepRecord], None]) -> Rollout:
    """``rollout`` then ``add_reference`` with every FSDP unit's weights gathered (all ranks together)."""

    def on_rank(run: Run, problems: list[Problem], step: int) -> StepRecord:
        with run.ranks.unsharded():
            record = rollout(run, problems, step)
            add_reference(run, record)
            record.ref_hidden = run.ranks.own(record.ref_hidden)
        return record

    return on_rank


def writer_rollout(rollout: Rollout) -> Rollout:
    """``rollout`` run on rank 0 alone for every rank's problems; each rank gets the rows of its
    own problems, as it would have sampled them. For rollouts whose ranks cannot draw tokens
    together: Ray workers, and the multi-turn tool task (its ranks' episodes would take
    different numbers of turns, so their decode steps would not pair up)."""

    def on_writer(run: Run, problems: list[Problem], step: int) -> StepRecord:
        ranks = run.ranks
        if ranks.size == 1:
            return rollout(run, problems, step)
        shares = ranks.gather(problems)

        def blocks() -> list[StepRecord]:
            whole = rollout(run, [p for share in shares for p in share], step)
            ends = list(itertools.accumulate(len(share) for share in shares))
            return [replace(whole.rows(end - len(share), end), group_ids=group_ids(len(share), run.cfg.group_size))
                    for share, end in zip(shares, ends)]

        return ranks.scatter(ranks.on_writer(blocks))

    return on_writer


def rank_rollout(recipe: ModuleType) -> Rollout:
    """The rollout a sharded run of ``recipe`` steps with: its ``sample`` (rank 0's alone for a tool
    task, ``writer_rollout``) and its ``add_reference``, both on gathered weights (``sharded_rollout``).
    A step given the plain ``sample`` would gather every layer again at every decode step."""
    alone = writer_rollout(recipe.sample)  # sharding.share_run leaves a tool task's sampler without SharedDraw

    def sample(run: Run, problems: list[Problem], step: int) -> StepRecord:
        return (recipe.sample if run.task.tool_use is None else alone)(run, problems, step)

    return sharded_rollout(sample, recipe.add_reference)


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True,
          recipe: ModuleType) -> dict[str, Any]:
    """``recipe.train`` (tether's recipe, or a copy's module) on this rank, stepping with ``rank_rollout(recipe)``."""
    return recipe.train(cfg, resume=resume, progress=progress, rollout=rank_rollout(recipe))
