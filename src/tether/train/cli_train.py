"""``tether train``: GRPO with a KL leash, with the recipe the config asks for.

``--workers N`` runs ``tether.train.recipe_ray``, ``--nproc N`` ``tether.train.recipe_sharded``,
else ``tether.train.recipe``; ``tether.train.train_command`` runs it. Both are imported when
the command runs, so the other subcommands load no model code.
"""

from __future__ import annotations

import argparse
import functools
from typing import Callable

from tether.train.config import TrainConfig
from tether.train.flags import ChoicesHelp, add_train_flags


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="GRPO with a KL leash on the embedded model (defaults) or --model.",
                       formatter_class=ChoicesHelp)
    add_train_flags(p)


def run(args: argparse.Namespace, train_fn: Callable[..., dict] | None = None) -> int:
    """``tether train``; ``train_fn``: a copied recipe's ``train`` in place of tether's recipes."""
    from tether.train import train_command

    if train_fn is not None:
        return train_command.run_train(args, train_command.copy_picker(train_fn),
                                       recipe=train_command.recipe_of(train_fn))
    return train_command.run_train(args, shipped_recipe)


def shipped_recipe(cfg: TrainConfig) -> Callable[..., dict]:
    """The recipe that runs ``cfg``: the Ray recipe with ``workers > 0``, the sharded one with
    ``nproc > 1``, else the single-process one."""
    from tether.train import recipe, recipe_sharded

    if cfg.workers > 0:
        from tether.train import recipe_ray  # Ray is imported for --workers runs only

        return recipe_ray.train
    if cfg.nproc > 1:
        return functools.partial(recipe_sharded.train, recipe=recipe)
    return recipe.train
