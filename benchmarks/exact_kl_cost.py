"""What the exact KL costs: in the loss pass (from the reference's kept hidden states) against a
separate no-grad pass of policy and reference (``exact_kl_tokens``).

One step's batch of the default run (``tether train`` defaults: the embedded SmolLM2-135M with
LoRA, 12 problems x 6 answers of up to 20 tokens) is sampled once; then, alternating, each
variant is timed ``--repeats`` times:

* ``loss pass``: the recipe's ``token_terms`` + backward over the micro-batches, as it trains;
* ``loss pass + exact KL``: the same with the record carrying the reference's hidden states;
* ``reference pass``: the reference stage alone (what the loss-pass KL adds to it: keeping hidden states);
* ``separate exact pass``: ``exact_kl_tokens(policy, reference, where=assistant mask)``;
* ``budget reading``: what ``kl_controller=budget`` spends per reading after the update, one
  no-grad policy pass against the kept hidden states (``tether.train.updates.answer_kl``); a
  step spends one reading when the update stays in the band, two or more when it moves it.

    python benchmarks/exact_kl_cost.py [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from tether.models.scoring import exact_kl_tokens
from tether.train.config import TrainConfig
from tether.train.recipe import accumulate_gradients, add_advantages, add_reference, sample, add_rewards, step_problems
from tether.train.updates import answer_kl
from tether.train.run import build_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    run = build_run(TrainConfig(threads=args.threads, out="runs/exact_kl_cost", eval_size=0))
    problems = step_problems(run, 0)
    record = sample(run, problems, 0)
    add_rewards(run, record, problems, 0)
    add_reference(run, record)
    add_advantages(run, record)
    plain = dataclasses.replace(record, ref_hidden=None)

    def reference_pass(keep: bool) -> None:
        with torch.no_grad():
            run.ref_scorer.score(record.tokens, record.attention_mask, where=record.assistant_mask, keep_hidden=keep)

    variants = {
        "loss pass": lambda: accumulate_gradients(run, plain),
        "loss pass + exact KL": lambda: accumulate_gradients(run, record),
        "reference pass": lambda: reference_pass(False),
        "reference pass + kept hidden states": lambda: reference_pass(True),
        "separate exact pass": lambda: exact_kl_tokens(run.models.policy, run.models.reference, record.tokens,
                                                       record.attention_mask, where=record.assistant_mask),
        "budget reading": lambda: torch.no_grad()(answer_kl)(run.actor, record),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            begin = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - begin)
    base = statistics.median(times["loss pass"])
    print(f"{len(record)} answers, {int(record.assistant_mask.sum())} answer tokens, "
          f"{int(record.attention_mask.sum())} tokens; {args.threads} threads, median of {args.repeats}")
    print("| variant | seconds | x loss pass |")
    print("|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {median / base:.2f} |")


if __name__ == "__main__":
    main()
