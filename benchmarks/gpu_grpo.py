"""One GRPO optimizer step on a GPU: tether's ``train_step`` against TRL's ``GRPOTrainer``, bf16.

The workload, its equalisation and the timing are ``e2e_grpo.py``'s (read its docstring):
the embedded SmolLM2-135M-Instruct, the ``arithmetic`` task, the same problems, group size,
completion limit (answers forced to the limit), optimizer and loss settings, LoRA and full
fine-tuning rows, each variant in a fresh process, one warm-up step then the median of K.
Here both run on ``cuda`` in bfloat16: tether with ``device=cuda, dtype=bfloat16`` (SDPA
attention, float32 reductions over the vocabulary), TRL with ``bf16=True`` on the same
bfloat16 weights, ``use_vllm=False`` (generation through ``model.generate``). Reported per
variant: median step wall time (the step function synchronises the GPU before it returns),
tokens/s (prompt + completion tokens of the step / step time) and the peak GPU memory
allocated by torch during a timed step (``torch.cuda.max_memory_allocated``, reset before
each step).

This file imports nothing heavy at import time and refuses to run without a visible CUDA GPU.
It has not run yet: no GPU was available to the session that wrote it.

    .venv-bench/bin/python benchmarks/gpu_grpo.py                 # both tools, both modes
    .venv-bench/bin/python benchmarks/gpu_grpo.py --prompts 16 --group 8 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEFAULT = {"prompts": 16, "group": 8, "max_new_tokens": 128}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=DEFAULT["prompts"])
    p.add_argument("--group", type=int, default=DEFAULT["group"])
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT["max_new_tokens"])
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant")
    p.add_argument("--modes", default="LoRA,full", help="comma-separated subset of LoRA,full")
    p.add_argument("--no-trl", action="store_true", help="tether rows only")
    p.add_argument("--timeout", type=float, default=3600.0)
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    # e2e_grpo.measure reads these
    args.natural_lengths, args.trl_gradient_checkpointing, args.threads = False, False, 1
    return args


def gpu_table(results: dict) -> str:
    from _common import markdown_table, mib
    from e2e_grpo import summarise

    rows = []
    for (tool, mode), result in results.items():
        if "error" in result:
            rows.append([mode, tool, f"failed: {result['error']}", "", "", ""])
            continue
        s = summarise(result)
        gpu = statistics.median(r["gpu_peak"] for r in result["records"])
        rows.append([mode, tool, f"{s['wall']:.3f}", f"{s['tokens']:.0f}", f"{s['tokens_per_s']:.0f}", mib(gpu)])
    return markdown_table(["mode", "tool", "median step (s)", "tokens/step", "tokens/s", "peak GPU memory (MiB)"], rows)


def main(argv=None) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"gpu_grpo.py: torch {torch.__version__} sees no CUDA GPU; run it on a machine with one.")
    from e2e_grpo import MODES, measure, trl_problem

    args = parse_args(argv)
    work = {"prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens, "threads": 1,
            "steps": args.warmup + args.steps, "natural_lengths": False, "trl_gradient_checkpointing": False,
            "device": "cuda", "dtype": "bfloat16"}
    why_not = None if args.no_trl else trl_problem()
    results = {}
    for mode in args.modes:
        results[("tether", mode)] = measure("tether", {**work, "lora": MODES[mode]}, args)
        if not args.no_trl:
            results[("TRL", mode)] = ({"error": why_not} if why_not else
                                      measure("TRL", {**work, "lora": MODES[mode]}, args))
    print(f"GRPO optimizer step, SmolLM2-135M-Instruct bfloat16 on {torch.cuda.get_device_name()}, "
          f"{args.prompts} prompts x {args.group} answers x {args.max_new_tokens} tokens (forced), no vLLM; "
          f"torch {torch.__version__}; median of {args.steps} steps after {args.warmup} warm-up\n")
    print(gpu_table(results))


if __name__ == "__main__":
    main()
