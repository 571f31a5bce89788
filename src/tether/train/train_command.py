"""``tether train`` for a given recipe: parse, launch ``--nproc`` ranks, run, report.

The CLI passes the shipped recipes (``tether.train.cli_train``); a recipe file's ``main`` passes
its own ``train`` (``python my_recipe.py [tether train flags]``), so a copy runs like ``tether
train``: the same flags, ``--nproc N`` ranks of the copy, the same line on Ctrl-C (naming the
copy in the resume command). A finished run is left as it is, with one line saying so.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from types import ModuleType
from typing import Callable

from tether.train import recipe_sharded
from tether.train.config import TrainConfig
from tether.train.flags import ChoicesHelp, Parser, add_train_flags, config_from_args
from tether.train.interrupt import interrupts_reach_the_run, report_interruption
from tether.train.launch import launch, needs_launch, settle_nproc
from tether.train.reporting import USER_ERRORS, fail, tether_warnings
from tether.train.run_state import RunStopped, finished_line
from tether.train.sharding import leave_ranks


def main(argv: list[str] | None = None, *, train_fn: Callable[..., dict], ray_workers: bool = False) -> int:
    """``python RECIPE.py [tether train flags]``: ``train_fn`` (the file's ``train``) run like ``tether
    train``; ``ray_workers``: it samples on ``--workers N`` Ray workers (``recipe_ray``)."""
    words = list(sys.argv[1:] if argv is None else argv)
    parser = Parser(prog="tether train", formatter_class=ChoicesHelp)
    add_train_flags(parser)
    args = parser.parse_args(words)
    args.argv = words
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as ``tether train``: nothing is downloaded
    with tether_warnings():
        return run_train(args, copy_picker(train_fn, ray_workers=ray_workers), recipe=recipe_of(train_fn))


def run_train(args: argparse.Namespace, pick: Callable[[TrainConfig], Callable[..., dict]], *,
              recipe: ModuleType | None = None) -> int:
    """Run ``tether train``'s parsed ``args`` with the recipe ``pick(cfg)`` returns; ``recipe``: the
    copied recipe's module (its ranks run the file, and a resume command names it), None for tether's."""
    cfg = None
    try:
        cfg = config_from_args(args)
        cfg = settle_nproc(cfg, given=args.nproc is not None or cfg.nproc != 1).validate()
        finished = finished_line(cfg) if args.resume else None  # checked as a resume would be
        if finished is not None:
            if not int(os.environ.get("RANK", "0")):
                print(finished)
            return 0
        if needs_launch(cfg):  # the launching process trains nothing; a copied recipe's ranks run the copy
            return launch(args.argv, cfg.nproc, script=None if recipe is None else recipe.__file__)
        with interrupts_reach_the_run():
            summary = pick(cfg)(cfg, resume=bool(args.resume), progress=not args.quiet)
        leave_ranks()  # a sharded run: every rank ends its process group together
    except (*USER_ERRORS, RunStopped) as exc:  # RunStopped: a process the run needs died; the line says why
        return fail("train", exc)
    except KeyboardInterrupt as exc:  # Ctrl-C: one line naming the checkpoint to resume from, status 130
        return report_interruption(cfg, exc, copied=recipe is not None)
    if int(os.environ.get("RANK", "0")):
        return 0  # rank 0 alone reports a sharded run
    _print_summary(summary)
    print(f"  run directory              {cfg.out}")
    return 0


def copy_picker(train_fn: Callable[..., dict], *,
                ray_workers: bool = False) -> Callable[[TrainConfig], Callable[..., dict]]:
    """The recipe that runs ``cfg`` for a copied recipe's ``train_fn``: itself, or its stages on
    sharded ranks with ``nproc > 1``. A Ray recipe (``ray_workers``) needs ``workers > 0`` and
    shards itself; any other copy runs without Ray workers."""

    def pick(cfg: TrainConfig) -> Callable[..., dict]:
        if ray_workers:
            if cfg.workers < 1:
                raise ValueError(f"workers={cfg.workers}: this recipe samples on Ray workers; pass --workers N "
                                 "(N >= 1), or run a copy of tether.train.recipe for one process.")
            return train_fn
        if cfg.workers > 0:
            raise ValueError(f"workers={cfg.workers}: a copied recipe runs in one process; run the Ray topology "
                             "with tether train --workers N, or copy tether.train.recipe_ray too.")
        return functools.partial(recipe_sharded.train, recipe=recipe_of(train_fn)) if cfg.nproc > 1 else train_fn

    return pick


def recipe_of(train_fn: Callable[..., dict]) -> ModuleType:
    """The module (a copied recipe's file) whose ``train`` is ``train_fn``."""
    return sys.modules[train_fn.__module__]


def _print_summary(summary: dict) -> None:
    print("\n== tether train: summary ==")
    for key, value in summary.items():
        if key == "units" or isinstance(value, list):  # in summary.json, for the reader of the file
            continue
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"  {key:26s} {shown}")
