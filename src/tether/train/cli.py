"""The ``tether`` command line: ``train``, ``eval``, ``export``, ``plot`` and ``cp``.

Each subcommand is a module, ``tether.train.cli_<name>``, with its ``add_parser`` and its
``run``; this one builds the parser and dispatches. ``tether train``'s flags come from
``TrainConfig`` (``tether.train.flags``); a user error prints one line on stderr and exits
with status 2 (``tether.train.reporting``); Ctrl-C during ``train`` prints the checkpoint to
resume from and exits with 130 (``tether.train.interrupt``); ``--nproc N`` runs the command
again in N processes (``tether.train.launch``). Nothing is downloaded: the Hub is set offline
for every command but ``export --push-to-hub``.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from tether.train import cli_cp, cli_eval, cli_export, cli_plot, cli_train
from tether.train.flags import Parser
from tether.train.launch import launch  # noqa: F401  (docs/design.md names it tether.train.cli.launch)
from tether.train.reporting import tether_warnings

SUBCOMMANDS = ("train", "eval", "export", "plot", "cp")


def main(argv: list[str] | None = None, *, train_fn: Callable[..., dict] | None = None) -> int:
    """The ``tether`` command; ``train_fn`` replaces the recipe of ``train`` (as a copied recipe's ``main`` does)."""
    parser = Parser(prog="tether", description="RL post-training of LLMs on a KL leash.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (cli_train, cli_eval, cli_export, cli_plot, cli_cp):
        module.add_parser(sub)
    args, unknown = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)[1:]  # the words after the subcommand
    if unknown:  # reported by the subcommand's parser, which knows its flags for a suggestion
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "push_to_hub", ""):  # the one command that asks for the network
        # Every from_pretrained call already passes local_files_only; this also covers code that
        # the user's task or reward file runs, and libraries imported after this point.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    handlers = {"train": lambda a: cli_train.run(a, train_fn), "eval": cli_eval.run, "export": cli_export.run,
                "plot": cli_plot.run, "cp": cli_cp.run}
    with tether_warnings():
        return handlers[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
