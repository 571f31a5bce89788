"""``tether export RUN OUT``: a run's policy as a Hugging Face model (or PEFT adapter) directory."""

from __future__ import annotations

import argparse

from tether.train.reporting import USER_ERRORS, fail


def add_parser(sub) -> None:
    x = sub.add_parser("export", help="Write a run's policy as a Hugging Face model (or PEFT adapter) directory.")
    x.add_argument("run_dir", metavar="RUN_DIR")
    x.add_argument("out", metavar="OUT", help="New directory to write (refused if it exists and is not empty).")
    x.add_argument("--merge", action="store_true", help="LoRA runs: merge the adapter into the base and write "
                   "the whole model; without it the adapter alone is written (a full fine-tune is always whole).")
    x.add_argument("--best", action="store_true", help="Export the best checkpoint (best/, kept by eval_every).")
    x.add_argument("--push-to-hub", metavar="REPO", default="", help="Also write a model card (README.md, figures/) "
                   "and upload OUT to the Hugging Face Hub model repo REPO (needs a token and network).")


def run(args: argparse.Namespace) -> int:
    from tether.train.export import export_run

    try:
        result = export_run(args.run_dir, args.out, merge=args.merge, best=args.best, push_to_hub=args.push_to_hub)
    except USER_ERRORS as exc:
        return fail("export", exc)
    print(f"tether export: wrote the {result.kind} model of step {result.step} ({result.checkpoint}) to {result.out}")
    if result.pushed:
        print(f"tether export: pushed {result.out} to {result.pushed}")
    return 0
