"""``tether plot RUN``: PNG plots of a run's ``metrics.jsonl`` (``tether.train.plots``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tether.train.reporting import USER_ERRORS, fail


def add_parser(sub) -> None:
    pl = sub.add_parser("plot", help="Write PNG plots of a run's metrics.jsonl.")
    pl.add_argument("run_dir")


def run(args: argparse.Namespace) -> int:
    from tether.train.plots import plot_metrics

    try:
        paths = plot_metrics(Path(args.run_dir))
    except USER_ERRORS as exc:
        return fail("plot", exc)
    for path in paths:
        print(path)
    return 0
