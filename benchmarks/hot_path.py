"""The scoring phases of the default training step, timed on one fixed batch: what the input
checks of the hot path cost (issue 44, item 4: check once, spans computed once per call).

One step's answers are sampled once (``recipe.sample`` with the config's seed, saved to
``--record`` so every later process, on whichever source tree, scores the same batch), then
each phase is timed ``--repeats`` times in this process: the reference pass
(``recipe.add_reference``), the loss pass (``recipe.accumulate_gradients``: every micro-batch's
forward and backward, no optimizer step, so the weights never move) and one budget reading
(``updates.answer_kl``, the exact KL per answer). ``--model tiny`` runs the same phases on the
tiny random model, where the forwards are cheap and the checks' share shows. Prints the
median and the spread (min-max) of each phase; run it once per source tree, interleaved:

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/hot_path.py --prompts 4 --record /tmp/hot.pt

benchmarks/results/hot_path.jsonl holds the raw times of issue 44 (base 75bca58 against this change,
labels base-N / branch-N in the order they ran) on a shared 2-core machine under heavy load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import markdown_table  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="the config's model (default: the embedded one)")
    p.add_argument("--prompts", type=int, default=12, help="prompts_per_step (the default config's: 12)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--record", default=None, help="where the sampled batch is kept (read when it exists)")
    p.add_argument("--label", default="", help="a name for this tree in the output")
    p.add_argument("--out", default=None, help="append one JSON line of the raw times here")
    return p.parse_args(argv)


def build(args):
    import torch

    from tether.train import recipe
    from tether.train.config import TrainConfig

    torch.set_num_threads(1)
    cfg = TrainConfig(model=args.model, threads=1, eval_size=0, prompts_per_step=args.prompts,
                      out=tempfile.mkdtemp(prefix="tether-hot-path-")).validate()
    run = recipe.build_run(cfg)
    if args.record and os.path.exists(args.record):
        record = torch.load(args.record, weights_only=False)
    else:
        problems = recipe.step_problems(run, 0)
        record = recipe.sample(run, problems, 0)
        recipe.add_rewards(run, record, problems, 0)
        if args.record:
            torch.save(record, args.record)
    return run, recipe, record


def phases(run, recipe, record) -> dict:
    from tether.train.updates import answer_kl

    def reference():
        record.ref_log_probs = record.ref_hidden = None
        recipe.add_reference(run, record)

    reference()
    recipe.add_advantages(run, record)
    return {
        "reference pass": reference,
        "loss pass (fwd + bwd)": lambda: recipe.accumulate_gradients(run, record),
        "budget reading": lambda: answer_kl(run.actor, record),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    run, recipe, record = build(args)
    timed = phases(run, recipe, record)
    for fn in timed.values():  # warm-up: the head probe, allocator arenas
        fn()
    times: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(args.repeats):  # phases interleaved, so a burst of load hits all of them
        for name, fn in timed.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    rows = [[name, f"{statistics.median(t):.3f}", f"{min(t):.3f}-{max(t):.3f}", str(len(t))]
            for name, t in times.items()]
    print(f"{args.label} {args.model}, {len(record)} answers x {record.tokens.shape[1]} columns, 1 thread")
    print(markdown_table(["phase", "median s", "spread (min-max) s", "repeats"], rows))
    if args.out:
        line = {"label": args.label, "model": args.model, "answers": len(record), "columns": record.tokens.shape[1],
                "threads": 1, "date": time.strftime("%Y-%m-%d"), "seconds": times}
        with open(args.out, "a") as fh:
            fh.write(json.dumps(line) + "\n")
    return times


if __name__ == "__main__":
    main()
