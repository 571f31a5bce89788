"""Where the default ``make train`` step spends its time on this CPU, against what the machine can do.

One step of the default config (or ``--model tiny`` for a smoke run) is split by recipe stage
(sampling, rewards, reference, advantages, loss forward + backward, the budget's KL readings,
the rest: clip, optimizer, logging). After a warm-up step, one step is timed and the next one's
floating-point operations are counted (``torch.utils.flop_counter.FlopCounterMode``, whose
per-op overhead would distort a timing); both sample fresh answers of the same config, so their
work differs only by the answers' lengths. The ceiling is a float32 matrix product of the
model's own shapes timed in the same process: a stage's GFLOP/s over it is the share of the
machine it uses (issue 29's goal: the step at >= 50 % of it). ``--ops`` profiles a third step
op by op (``torch.profiler``, per stage): how much of each stage is matrix products and
attention, at what rate, and which other ops take the rest (its floor and the cause of the gap).

    python benchmarks/step_profile.py                 # the default step, embedded model
    python benchmarks/step_profile.py --model tiny --steps-json runs/profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STAGES = ("sample", "add_rewards", "add_reference", "add_advantages", "accumulate_gradients", "hold_kl_budget")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="the config's model (default: the embedded one)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", help="the config's dtype (bfloat16 runs the products in bf16)")
    p.add_argument("--ceiling-seconds", type=float, default=3.0, help="how long the matmul ceiling is timed")
    p.add_argument("--steps-json", default=None, help="write the table as JSON here")
    p.add_argument("--ops", action="store_true", help="also profile a third step op by op, per stage")
    return p.parse_args(argv)


def matmul_ceiling(rows: int, inner: int, cols: int, seconds: float) -> float:
    """GFLOP/s of a float32 ``[rows, inner] @ [inner, cols]`` product, best of repeated timings."""
    import torch

    a, b = torch.randn(rows, inner), torch.randn(inner, cols)
    flops, best, deadline = 2.0 * rows * inner * cols, float("inf"), time.perf_counter() + seconds
    a @ b  # warm-up
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def staged(recipe, wrap, names=STAGES) -> dict:
    """Replace each stage ``names`` of ``recipe`` with ``wrap(name, fn)``; returns the originals."""
    originals = {name: getattr(recipe, name) for name in names}
    for name, fn in originals.items():
        setattr(recipe, name, wrap(name, fn))
    return originals


def profile_step(run, recipe, step: int) -> tuple[dict[str, float], dict[str, float]]:
    """``(seconds, GFLOP)`` per stage of steps ``step`` and ``step + 1``, plus ``step`` and ``rest``."""
    from torch.utils.flop_counter import FlopCounterMode

    seconds: dict[str, float] = {}

    def timed(name, fn):
        def inner(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        return inner

    originals = staged(recipe, timed)
    try:
        start = time.perf_counter()
        recipe.train_step(run, step, recipe.sample)
        seconds["step"] = time.perf_counter() - start
    finally:
        staged(recipe, lambda name, _: originals[name])
    seconds["rest"] = max(0.0, seconds["step"] - sum(v for k, v in seconds.items() if k != "step"))

    flops: dict[str, float] = {}

    def counted(name, fn):
        def inner(*a, **k):
            with FlopCounterMode(display=False) as counter:
                out = fn(*a, **k)
            flops[name] = flops.get(name, 0.0) + counter.get_total_flops() / 1e9
            return out
        return inner

    originals = staged(recipe, counted)
    try:
        with FlopCounterMode(display=False) as whole:
            recipe.train_step(run, step + 1, recipe.sample)
    finally:
        staged(recipe, lambda name, _: originals[name])
    flops["step"] = whole.get_total_flops() / 1e9
    flops["rest"] = max(0.0, flops["step"] - sum(v for k, v in flops.items() if k != "step"))
    return seconds, flops


# The kernels of matrix products and attention: what the FLOP count counts.
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
              "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def profile_ops(run, recipe, step: int) -> dict[str, dict]:
    """Per stage of step ``step``: the self time of the matmul kernels and of every other op, from
    one ``torch.profiler`` run per stage call."""
    from torch.profiler import ProfilerActivity, profile

    found: dict[str, dict] = {}

    def profiled(name, fn):
        def inner(*a, **k):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = fn(*a, **k)
            stage = found.setdefault(name, {"matmul": 0.0, "other": {}})
            for event in prof.key_averages():
                seconds = event.self_cpu_time_total / 1e6
                if event.key in MATMUL_OPS:
                    stage["matmul"] += seconds
                else:
                    stage["other"][event.key] = stage["other"].get(event.key, 0.0) + seconds
            return out
        return inner

    originals = staged(recipe, profiled)
    try:
        recipe.train_step(run, step, recipe.sample)
    finally:
        staged(recipe, lambda name, _: originals[name])
    return found


def print_ops(found: dict[str, dict], flops: dict[str, float]) -> None:
    """The op table. An op's time is the span of its call on the thread that made it (its threads
    run inside that span), so the columns add up to about the stage's wall time."""
    print("\n| stage | matmul s | their GFLOP/s | other ops s | largest other ops (s) |")
    print("|---|---|---|---|---|")
    for name in STAGES:
        if name not in found:
            continue
        stage = found[name]
        other = sum(stage["other"].values())
        top = sorted(stage["other"].items(), key=lambda kv: -kv[1])[:5]
        rate = flops.get(name, 0.0) / stage["matmul"] if stage["matmul"] else 0.0
        names = ", ".join(f"{k.removeprefix('aten::')} {v:.2f}" for k, v in top)
        print(f"| {name} | {stage['matmul']:.2f} | {rate:.0f} | {other:.2f} | {names} |")


def main(argv=None) -> dict:
    import torch

    args = parse_args(argv)
    from tether.train import recipe
    from tether.train.config import TrainConfig

    torch.set_num_threads(args.threads)
    out = tempfile.mkdtemp(prefix="tether-step-profile-")
    cfg = TrainConfig(model=args.model, threads=args.threads, eval_size=0, dtype=args.dtype, out=out).validate()
    run = recipe.build_run(cfg)
    kept: list = []
    recipe.train_step(run, 0, lambda *a: kept.append(recipe.sample(*a)) or kept[-1])  # warm-up
    seconds, flops = profile_step(run, recipe, 1)
    hidden = run.models.policy.get_input_embeddings().embedding_dim
    rows = int(kept[0].attention_mask.sum())  # the step's tokens: the rows of its matrix products
    ceiling = matmul_ceiling(rows, hidden, 3 * hidden, args.ceiling_seconds)
    table = []
    print(f"one default step ({args.model}, {args.dtype}, {args.threads} threads): float32 matmul ceiling "
          f"{ceiling:.0f} GFLOP/s ([{rows}, {hidden}] @ [{hidden}, {3 * hidden}] float32)\n")
    print("| stage | seconds | GFLOP | GFLOP/s | of the ceiling |\n|---|---|---|---|---|")
    for name in (*STAGES, "rest", "step"):
        s, f = seconds.get(name, 0.0), flops.get(name, 0.0)
        rate = f / s if s > 0 else 0.0
        table.append({"stage": name, "seconds": s, "gflop": f, "gflop_per_s": rate, "of_ceiling": rate / ceiling})
        print(f"| {name} | {s:.2f} | {f:.1f} | {rate:.0f} | {100 * rate / ceiling:.0f} % |")
    report = {"model": args.model, "threads": args.threads, "ceiling_gflop_per_s": ceiling, "stages": table}
    if args.ops:
        found = profile_ops(run, recipe, 3)
        print_ops(found, flops)
        report["ops"] = found
    if args.steps_json:
        with open(args.steps_json, "w") as fh:
            json.dump(report, fh, indent=1)
    return report


if __name__ == "__main__":
    main()
