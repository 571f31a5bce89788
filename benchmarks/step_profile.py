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

A run of the embedded model appends its record to ``benchmarks/results/step_profile.jsonl``
(``--results DIR`` elsewhere; a ``--model tiny`` run records only into a ``--results`` given), from
which ``benchmarks/tables.py`` builds docs/performance.md's tables with ``table`` and ``ops_table``.

    python benchmarks/step_profile.py --threads 2 --ops   # the default step, embedded model
    python benchmarks/step_profile.py --model tiny --results /tmp/profile
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402

STAGES = ("sample", "add_rewards", "add_reference", "add_advantages", "accumulate_gradients", "hold_kl_budget")
TITLES = {"sample": "sampling (prefill and decode)", "add_rewards": "rewards",
          "add_reference": "reference (log-probs and kept hidden states)", "add_advantages": "advantages",
          "accumulate_gradients": "loss forward + backward (with the exact KL)",
          "hold_kl_budget": "the budget's KL readings", "rest": "clip, optimizer, logging", "step": "step"}
COMMAND = "python benchmarks/step_profile.py --threads 2 --ops"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="the config's model (default: the embedded one)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", help="the config's dtype (bfloat16 runs the products in bf16)")
    p.add_argument("--ceiling-seconds", type=float, default=3.0, help="how long the matmul ceiling is timed")
    p.add_argument("--results", default=None,
                   help="folder of step_profile.jsonl (default: benchmarks/results; a tiny-model run records only here)")
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


def _ops_record(found: dict[str, dict]) -> dict[str, dict]:
    """Per stage: the matmul kernels' seconds, the other ops' total and their five largest."""
    out = {}
    for name, stage in found.items():
        top = sorted(stage["other"].items(), key=lambda kv: -kv[1])[:5]
        out[name] = {"matmul_s": stage["matmul"], "other_s": sum(stage["other"].values()),
                     "largest_other_s": [[k.removeprefix("aten::"), v] for k, v in top]}
    return out


def _fmt(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def table(records: list[dict[str, Any]]) -> str:
    """The newest recorded step of each model and dtype: seconds, GFLOP and the share of the
    record's own matmul ceiling per stage."""
    newest = {(r["model"], r["dtype"]): r for r in records}
    if not newest:
        return f"No profile is recorded yet: `{COMMAND}` records one in `benchmarks/results/step_profile.jsonl`."
    parts = []
    for (model, dtype), r in sorted(newest.items()):
        ceiling = r["ceiling_gflop_per_s"]
        lines = ["| stage | seconds | GFLOP | GFLOP/s | of the ceiling |", "|---|---|---|---|---|"]
        for st in r["stages"]:
            rate = st["gflop"] / st["seconds"] if st["seconds"] > 0 else 0.0
            bold = "**" if st["stage"] == "step" else ""
            cells = [TITLES[st["stage"]], _fmt(st["seconds"], 2), _fmt(st["gflop"], 1) if st["gflop"] else "0",
                     _fmt(rate) if st["gflop"] else "", f"{100 * rate / ceiling:.0f} %" if st["gflop"] else ""]
            lines.append("| " + " | ".join(f"{bold}{c}{bold}" if c else "" for c in cells) + " |")
        parts.append("\n".join(lines) + f"\n\n{model} model, {dtype}, threads: {r['threads']}, ceiling {ceiling:,.0f} GFLOP/s "
                     f"(`{r['ceiling_shape']}` float32); {r['machine']}, {r['date']}, commit {r['commit']}.")
    return "\n\n".join(parts)


def ops_table(records: list[dict[str, Any]]) -> str:
    """The op split of the newest record that holds one (``--ops``)."""
    found = [r for r in records if r.get("ops")]
    if not found:
        return f"No op profile is recorded yet: `{COMMAND}` records one."
    r = found[-1]
    gflop = {st["stage"]: st["gflop"] for st in r["stages"]}
    lines = ["| stage | matrix products and attention (s) | their GFLOP/s | other ops (s) | largest other ops (s) |",
             "|---|---|---|---|---|"]
    for name in STAGES:
        if name not in r["ops"]:
            continue
        op = r["ops"][name]
        rate = gflop.get(name, 0.0) / op["matmul_s"] if op["matmul_s"] else 0.0
        names = ", ".join(f"{k} {v:.2f}" for k, v in op["largest_other_s"])
        lines.append(f"| {TITLES[name].split(' (')[0]} | {op['matmul_s']:.2f} | {rate:,.0f} | {op['other_s']:.2f} | {names} |")
    return "\n".join(lines) + f"\n\n{r['model']} model, {r['dtype']}; {r['machine']}, {r['date']}, commit {r['commit']}."


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
    stages = [{"stage": name, "seconds": seconds.get(name, 0.0), "gflop": flops.get(name, 0.0)}
              for name in (*STAGES, "rest", "step")]
    record = {"run": _results.run_id(), "model": args.model,
              "dtype": args.dtype, "threads": args.threads, "torch": torch.__version__,
              "ceiling_gflop_per_s": ceiling, "ceiling_shape": f"[{rows}, {hidden}] @ [{hidden}, {3 * hidden}]",
              "stages": stages, **_results.stamp()}
    if args.ops:
        record["ops"] = _ops_record(profile_ops(run, recipe, 3))
    print(table([record]))
    if args.ops:
        print("\n" + ops_table([record]))
    root = _results.destination(args.results, quick=args.model != "default")  # a smoke model records only where told
    if root is not None:
        _results.write("step_profile", record, key=("run",), root=root)
    return record


if __name__ == "__main__":
    main()
