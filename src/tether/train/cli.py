"""The ``tether`` command line: ``train``, ``eval`` and ``plot``.

``tether train`` flags are generated from ``TrainConfig``'s fields (``--prompts-per-step 8``
sets ``prompts_per_step``), and their help is the field documentation. ``--config FILE``
loads a YAML file first; trailing ``key=value`` words override both.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from tether.train.config import TrainConfig


def _train_parser(sub) -> None:
    # Flags default to None (meaning "not given", so --config and overrides can apply); the real
    # default is the config field's, written into each help line by hand.
    p = sub.add_parser("train", help="GRPO with a KL leash on the embedded model (defaults) or --model.")
    p.add_argument("--config", help="YAML file of config keys, applied before flags and key=value overrides.")
    p.add_argument("--resume", metavar="RUN_DIR", help="Continue RUN_DIR from its last checkpoint with its config.yaml.")
    p.add_argument("--quiet", action="store_true", help="No progress bar.")
    for f in fields(TrainConfig):
        p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None,
                       metavar=type(f.default).__name__.upper(), help=f"{f.metadata['help']} (default: {f.default})")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="Config overrides.")


def _parse_overrides(words: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for word in words:
        if "=" not in word:
            raise SystemExit(f"tether train: expected key=value overrides, got {word!r}.")
        key, value = word.split("=", 1)
        out[key.strip().replace("-", "_")] = value
    return out


def _config(args: argparse.Namespace) -> TrainConfig:
    if args.resume:
        cfg = TrainConfig.from_yaml(Path(args.resume) / "config.yaml")
        return cfg.override({"out": args.resume})
    cfg = TrainConfig.from_yaml(args.config) if args.config else TrainConfig()
    flags = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name) is not None}
    return cfg.override({**flags, **_parse_overrides(args.overrides)})


def _print_summary(summary: dict) -> None:
    print("\n== tether train: summary ==")
    for key, value in summary.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"  {key:26s} {shown}")


def cmd_train(args: argparse.Namespace) -> int:
    from tether.train.recipe import train

    try:
        cfg = _config(args).validate()
    except ValueError as exc:
        print(f"tether train: {exc}", file=sys.stderr)
        return 2
    summary = train(cfg, resume=bool(args.resume), progress=not args.quiet)
    _print_summary(summary)
    print(f"  run directory              {cfg.out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from tether.train.evaluate import evaluate
    from tether.train.recipe import build_run
    from tether.train.checkpoint import latest_checkpoint, load_checkpoint

    if args.run:
        cfg = TrainConfig.from_yaml(Path(args.run) / "config.yaml").override({"out": args.run})
    else:
        cfg = TrainConfig().override({"model": args.model, "task": args.task, "out": "runs/eval"})
    cfg = cfg.override({"eval_size": args.eval_size}) if args.eval_size else cfg
    run = build_run(cfg)
    if args.run:
        path = latest_checkpoint(Path(args.run))
        if path is None:
            print(f"tether eval: no checkpoint under {args.run}/checkpoints", file=sys.stderr)
            return 2
        load_checkpoint(path, policy=run.models.policy, optimizer=run.optimizer,
                        reference=run.models.movable_reference)
    result = evaluate(run.models.policy, run.models.reference, run.models.tokenizer, run.task, run.held_out,
                      max_new_tokens=cfg.eval_max_new_tokens, temperature=cfg.temperature)
    print(json.dumps(result.as_dict(), indent=1))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from tether.train.metrics import plot_metrics

    for path in plot_metrics(Path(args.run_dir)):
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tether", description="RL post-training of LLMs on a KL leash.")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    e = sub.add_parser("eval", help="Held-out accuracy and KL of a run's last checkpoint or of an untrained model.")
    e.add_argument("run", nargs="?", help="Run directory (its config.yaml and last checkpoint).")
    e.add_argument("--model", default="default", help="Model when no run directory is given.")
    e.add_argument("--task", default="arithmetic", help="Task when no run directory is given.")
    e.add_argument("--eval-size", type=int, default=0, help="Override the held-out set size.")
    pl = sub.add_parser("plot", help="Write PNG plots of a run's metrics.jsonl.")
    pl.add_argument("run_dir")
    args = parser.parse_args(argv)
    handlers = {"train": cmd_train, "eval": cmd_eval, "plot": cmd_plot}
    return handlers[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
