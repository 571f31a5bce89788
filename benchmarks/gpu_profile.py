"""Where one tether GRPO step spends its time on a GPU: the stages, and the kernels and ops within.

``gpu_grpo.py`` gives the step's wall time and four phases; this splits the step by recipe stage
(sampling, rewards, reference, loss forward + backward, optimizer, the budget's KL readings) with
``torch.profiler`` ranges, for each KL controller named, on the same model and workload (16
prompts x 8 answers x 128 forced tokens), then profiles a step that replays the warm-up's answers
(the decode loop's many small ops would swamp the profiler) and prints its top ops by device time
and by host time. ``--model llama-tiny --device cpu`` is the smoke run of the same code.

    python benchmarks/gpu_profile.py --model llama-1b --tokenizer wheels/tokenizer --json $OUT/profile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STAGES = ("sample", "add_rewards", "add_reference", "add_advantages", "accumulate_gradients", "hold_kl_budget")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b", choices=("llama-1b", "llama-tiny"))
    p.add_argument("--tokenizer", default=None, help="directory holding the embedded tokenizer")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--controllers", default="budget,constant", help="comma-separated kl_controller names")
    p.add_argument("--lora", action="store_true", help="LoRA (default: full fine-tuning)")
    p.add_argument("--rows", type=int, default=25, help="ops listed per table")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def stage_seconds(run, recipe, step: int, sync, rollout=None) -> dict[str, float]:
    """One ``train_step`` with each stage timed by ``step_clock.PhaseClock`` (the device
    synchronised around each, each a profiler range); ``rollout``: the step's answers (default: sampled)."""
    import torch
    from step_clock import PhaseClock

    clock, originals = PhaseClock(), {name: getattr(recipe, name) for name in STAGES}

    def synced(name, fn):
        def inner(*a, **k):
            sync()
            with torch.profiler.record_function(f"stage:{name}"):
                out = fn(*a, **k)
            sync()
            return out
        return inner

    for name, fn in originals.items():
        setattr(recipe, name, clock.wrap(name, synced(name, fn)))
    try:
        sync()
        start = time.perf_counter()
        recipe.train_step(run, step, rollout or recipe.sample)
        sync()
        wall = time.perf_counter() - start
    finally:
        for name, fn in originals.items():
            setattr(recipe, name, fn)
    seconds = {**clock.seconds, "step": wall}
    seconds["rest (clip, optimizer, bookkeeping)"] = wall - sum(clock.seconds.values())
    return seconds


def main(argv=None) -> None:
    import torch

    args = parse_args(argv)
    import random_llama
    from e2e_grpo import train_config

    from tether.train import recipe

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    folder = tempfile.mkdtemp(prefix="tether-profile-")
    size = args.model.removeprefix("llama-")
    tokenizer = random_llama.embedded_tokenizer(args.tokenizer)
    model = str(random_llama.build_random_llama(size, os.path.join(folder, "model"), tokenizer=tokenizer,
                                                dtype=args.dtype, device=args.device))
    work = {"prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens, "threads": 1,
            "steps": 3, "natural_lengths": False, "lora": args.lora, "device": args.device, "dtype": args.dtype,
            "model": model}
    report = {"model": args.model, "device": torch.cuda.get_device_name() if cuda else "CPU", "lora": args.lora,
              "torch": torch.__version__, "controllers": {}}
    for name in [c.strip() for c in args.controllers.split(",") if c.strip()]:
        cfg = train_config(work, out=os.path.join(folder, name)).override({"kl_controller": name}).validate()
        run = recipe.build_run(cfg)
        run.sampler.eos_ids = {-1}  # every answer runs to max_new_tokens
        kept = []
        stage_seconds(run, recipe, 0, sync, lambda *a: kept.append(recipe.sample(*a)) or dataclasses.replace(kept[0]))
        timed = stage_seconds(run, recipe, 1, sync)
        entry = {"stages_s": timed}
        print(f"\n== kl_controller={name}: " + ", ".join(f"{k} {v:.3f}s" for k, v in timed.items()), flush=True)
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:  # the warm-up's answers again: no decode loop
            stage_seconds(run, recipe, 0, sync, lambda *a: dataclasses.replace(kept[0]))
        events = prof.key_averages()
        for key in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
            table = events.table(sort_by=key, row_limit=args.rows, max_name_column_width=60)
            print(f"-- top ops by {key}\n{table}", flush=True)
            entry[key] = table
        report["controllers"][name] = entry
        del run
        if cuda:
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
