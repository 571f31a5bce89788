"""The loss's forward and backward under ``--dtype`` and ``--gradient-checkpointing``.

What is timed: ``accumulate_gradients`` (the GRPO loss forward and backward over one step's
batch, micro-batch by micro-batch) on the embedded SmolLM2-135M-Instruct, for float32 and
bfloat16 weights, with and without gradient checkpointing, LoRA (tether's defaults) and full
fine-tuning. The batch is sampled once per process from the same seeded prompts with every
answer forced to ``max_new_tokens`` tokens (no token ends a row), so each variant processes
the same token count; sampling, reward and reference scoring are set-up, not timed. Each
variant runs in a fresh process (``_common``); memory is the peak resident-set growth over
the steady state, i.e. what the loss's activations and gradients add.

    .venv/bin/python benchmarks/precision.py            # 2 prompts x 4 answers x 24 tokens, LoRA
    .venv/bin/python benchmarks/precision.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import markdown_table, measure_in_subprocess, mib  # noqa: E402

FULL = {"prompts": 2, "group": 4, "max_new_tokens": 24, "micro_batch_size": 8}
QUICK = {"prompts": 2, "group": 2, "max_new_tokens": 4, "micro_batch_size": 4}


def setup(dtype: str, checkpointing: bool, lora_rank: int, prompts: int, group: int, max_new_tokens: int,
          micro_batch_size: int, threads: int):
    """A zero-argument callable running the loss forward and backward on a fixed batch."""
    import torch

    from tether.train.config import TrainConfig
    from tether.train.recipe import (accumulate_gradients, add_advantages, add_reference, build_run, sample,
                                     add_rewards, step_problems)

    folder = tempfile.TemporaryDirectory()
    cfg = TrainConfig(out=folder.name, dtype=dtype, gradient_checkpointing=checkpointing, lora_rank=lora_rank,
                      prompts_per_step=prompts, group_size=group, max_new_tokens=max_new_tokens,
                      micro_batch_size=micro_batch_size, eval_size=0, threads=threads, device="cpu")
    run = build_run(cfg)
    run.sampler.eos_ids = {-1}  # no token id matches: every answer runs to max_new_tokens
    problems = step_problems(run, 0)
    batch = sample(run, problems, 0)
    add_rewards(run, batch, problems, 0)
    add_reference(run, batch)
    add_advantages(run, batch)
    torch.manual_seed(0)

    def step() -> None:
        accumulate_gradients(run, batch)
        run.optimizer.zero_grad(set_to_none=True)  # release the gradients: each call counts afresh

    step.folder = folder  # kept alive with the callable
    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Tiny batch, one repeat: checks the script runs.")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--full-finetune", action="store_true", help="Also the rows with lora_rank=0.")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    rows = []
    for lora_rank in (16, 0) if args.full_finetune else (16,):
        for dtype in ("float32", "bfloat16"):
            for checkpointing in (False, True):
                kwargs = {"dtype": dtype, "checkpointing": checkpointing, "lora_rank": lora_rank,
                          "threads": args.threads, **shape}
                m = measure_in_subprocess(__file__, "setup", kwargs, repeats=1 if args.quick else args.repeats)
                rows.append(["LoRA r16" if lora_rank else "full", dtype, "on" if checkpointing else "off",
                             f"{m.median_s:.2f}", f"{m.cpu_median_s:.2f}", mib(m.peak_rss_growth_bytes)])
                print(" | ".join(rows[-1]), flush=True)
    tokens = shape["prompts"] * shape["group"]
    print(f"\nloss forward+backward, {tokens} sequences x {shape['max_new_tokens']} answer tokens, "
          f"{args.threads} threads\n")
    print(markdown_table(["policy", "dtype", "checkpointing", "wall s", "CPU s", "peak RSS growth"], rows))


if __name__ == "__main__":
    main()
