"""``tether eval [RUN]``: held-out accuracy and KL of a run's checkpoint or of an untrained model.

A run directory is data: a task or reward file it names runs only with ``--trust-task-code``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tether.train.config import TrainConfig
from tether.train.reporting import USER_ERRORS, fail
from tether.train.run_dir import RESUMABLE_KEYS, best_root, read_run_config
from tether.train.tasks import TASKS


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="Held-out accuracy and KL of a run's last checkpoint or of an untrained model.")
    e.add_argument("run", nargs="?", help="Run directory (its config.yaml and last checkpoint).")
    e.add_argument("--model", default="default", help="Model when no run directory is given.")
    e.add_argument("--task", default="arithmetic", help="Task when no run directory is given.")
    e.add_argument("--eval-size", type=int, default=0, help="Override the held-out set size.")
    e.add_argument("--trust-task-code", action="store_true",
                   help="Run the task or reward-functions .py file named in RUN's config.yaml (code from the run directory).")
    e.add_argument("--best", action="store_true", help="Score RUN's best checkpoint (best/, kept by eval_every).")


def run(args: argparse.Namespace) -> int:
    try:
        return _eval(args)
    except USER_ERRORS as exc:
        return fail("eval", exc)


def _eval(args: argparse.Namespace) -> int:
    from tether.train.checkpoint import open_checkpoint
    from tether.train.metrics import evaluate
    from tether.train.run import build_run

    if args.run:
        cfg = read_run_config(Path(args.run))
        code = [f for f in (None if cfg.task in TASKS else cfg.task, cfg.reward_funcs) if f]
        if code and not args.trust_task_code:
            # A run directory is data: running the code it names needs the user's say-so.
            raise ValueError(
                f"{Path(args.run) / 'config.yaml'} names the task or reward file {' and '.join(code)}, which would "
                "run as Python code. Pass --trust-task-code if you trust that file."
            )
    else:
        cfg = TrainConfig().override({"model": args.model, "task": args.task, "out": "runs/eval"})
    cfg = cfg.override({"eval_size": args.eval_size}) if args.eval_size else cfg
    cfg = cfg.override({"nproc": 1})  # a sharded run's checkpoint holds whole tensors: one process scores it
    if args.best and not args.run:
        raise ValueError("--best: give the run directory whose best checkpoint to score (tether eval RUN --best).")
    root = best_root(Path(args.run), required=True) if args.best else None
    run = build_run(cfg)
    scored: dict[str, object] = {"checkpoint": None, "step": 0}
    if args.run:
        ckpt, _ = open_checkpoint(cfg, run.models, run.optimizer, allowed=(*RESUMABLE_KEYS, "eval_size", "nproc"),
                                  root=root)
        scored = {"checkpoint": str(ckpt.path), "step": ckpt.step}
        what = f"{ckpt.path} (step {ckpt.step} of {cfg.steps})"
    else:
        what = f"the untrained model {cfg.model!r} (step 0)"
    print(f"tether eval: scoring {what} on {len(run.held_out)} held-out problems", file=sys.stderr)
    result = evaluate(run.models.policy, run.models.reference, run.models.tokenizer, run.task, run.held_out,
                      max_new_tokens=cfg.eval_max_new_tokens, temperature=cfg.temperature,
                      reward=run.reward, prompt_format=cfg.prompt_format, progress=True)
    print(json.dumps({**scored, **result.as_dict()}, indent=1))
    return 0
