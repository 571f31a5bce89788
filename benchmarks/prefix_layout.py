"""What planning the shared prompts on left-aligned rows saves on the default step's record.

The sampler's record is left-padded: each row ends at the last column, so the copies of one prompt
start at columns that differ by their answers' lengths, and a prefix cut (one column for every row)
saw up to one distinct prefix per answer length. Since 57e1ec0 ``score_tokens(share_prefix=True)``
plans on the rows moved to column 0 (``score_plan.left_aligned``). This script samples one step of
the default config, prints what each plan sends through the decoder, then times the stages that
score the record (reference, loss forward + backward, one budget reading), alternating the plan on
the batch's own grid (the code before, restored here by an identity ``left_aligned``) with the
plan on left-aligned rows; medians of ``--repeats``.

    python benchmarks/prefix_layout.py [--repeats 3] [--threads 2] [--model tiny]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="default", help="the config's model (tiny: a smoke run)")
    args = parser.parse_args(argv)

    import torch

    import tether.models.scoring as scoring
    from tether.models.packing import plan_prefix_split
    from tether.models.score_plan import Spans
    from tether.train import recipe
    from tether.train.config import TrainConfig
    from tether.train.updates import answer_kl

    torch.set_num_threads(args.threads)
    run = recipe.build_run(TrainConfig(model=args.model, threads=args.threads, eval_size=0, out=tempfile.mkdtemp()))
    recipe.train_step(run, 0)  # warm-up, and a policy that differs from the reference
    problems = recipe.step_problems(run, 1)
    record = recipe.sample(run, problems, 1)
    recipe.add_rewards(run, record, problems, 1)
    plans = {"batch grid": lambda tokens, spans: (tokens, spans.mask, torch.arange(tokens.numel())),
             "left-aligned rows": scoring.left_aligned}
    total = int(record.attention_mask.sum())
    print(f"{record.tokens.shape[0]} rows, {total} tokens, {int(record.assistant_mask.sum())} answer tokens")
    for name, plan in plans.items():
        split = plan_prefix_split(*plan(record.tokens, Spans.of(record.attention_mask))[:2])
        print(f"  plan on the {name}: {total - (split.tokens_saved if split else 0)} decoder tokens"
              + (f", {len(split.representatives)} distinct prefixes cut at column {split.width}" if split else ""))

    seconds: dict[str, list[tuple[float, float, float]]] = {name: [] for name in plans}
    try:
        for _ in range(args.repeats):
            for name, plan in plans.items():
                scoring.left_aligned = plan
                record.ref_log_probs = record.ref_hidden = None
                start = time.perf_counter()
                recipe.add_reference(run, record)
                reference = time.perf_counter()
                recipe.add_advantages(run, record)
                run.optimizer.zero_grad(set_to_none=True)
                recipe.accumulate_gradients(run, record)
                loss = time.perf_counter()
                with torch.no_grad():
                    answer_kl(run.actor, record)
                seconds[name].append((reference - start, loss - reference, time.perf_counter() - loss))
    finally:
        scoring.left_aligned = plans["left-aligned rows"]
        run.optimizer.zero_grad(set_to_none=True)
    print(f"\n| plan | reference (s) | loss forward + backward (s) | budget reading (s) |  (median of {args.repeats})")
    print("|---|---|---|---|")
    medians = {}
    for name, rows in seconds.items():
        medians[name] = [statistics.median(row[i] for row in rows) for i in range(3)]
        print(f"| {name} | " + " | ".join(f"{s:.2f}" for s in medians[name]) + " |")
    return medians


if __name__ == "__main__":
    main()
