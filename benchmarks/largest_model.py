"""The largest random Llama one GPU trains a GRPO step on, tether and TRL side by side (issue 46, item 4).

Per tool (tether, TRL) and mode (full, LoRA) the sizes of ``--sizes`` (``random_llama.SHAPES``,
default 1b, 3b, 8b) are tried in increasing order, each attempt gpu_grpo.py's workload in a fresh
process (``e2e_grpo.measure``: warm-up steps, then timed steps) at 16 prompts x 8 answers x 256
tokens. An attempt that runs out of memory (CUDA's ``OutOfMemoryError``, the CPU allocator's
"can't allocate memory") is a row with ``fits: false`` and its error line; any other failure is
``fits: null``. A tool and mode stops climbing at its first size that does not fit or fails.
``--memory-cap-mib`` holds each attempt to that much memory (``_common.cap_memory``): an 80 GB
card on an H200, or the cap that stops ``tiny-wide`` in the CPU dry run. ``--budget-seconds``: an
attempt is not started with less time left than it should take (the same tool and mode's last
attempt scaled by parameters, else ``--least-s``); it is killed when the time left runs out. Rows
(``--record``, after each attempt) are gpu_grpo.py's with ``bench: largest-model``, ``size``,
``fits``, ``error``; sizes not started are in ``--json``'s ``not_started``.

    .venv-bench/bin/python benchmarks/largest_model.py --record benchmarks/results/gpu_grpo.jsonl
    python benchmarks/largest_model.py --device cpu --dtype float32 --sizes tiny,tiny-wide,1b4 \\
        --tools tether --prompts 2 --group 2 --max-new-tokens 4 --warmup 0 --memory-cap-mib 200
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_grpo  # noqa: E402
import random_llama  # noqa: E402

BENCH = "largest-model"
TOOLS, MODES = ("tether", "TRL"), ("full", "LoRA")
# an attempt's error line that says the memory ran out (CUDA, torch's CPU allocator, Python, Rust)
OUT_OF_MEMORY = ("OutOfMemoryError", "out of memory", "can't allocate memory", "Cannot allocate memory",
                 "MemoryError", "memory allocation of")


def _subset(p: argparse.ArgumentParser, flag: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    chosen = [w.strip() for w in text.split(",") if w.strip()]
    if not chosen or set(chosen) - set(allowed):
        p.error(f"{flag}: expected a comma-separated subset of {','.join(allowed)}, got {text!r}")
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1b,3b,8b", help="random_llama.SHAPES names, smallest first")
    p.add_argument("--tools", default="tether,TRL")
    p.add_argument("--modes", default="full,LoRA")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=1, help="timed steps per attempt")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per attempt")
    p.add_argument("--memory-cap-mib", type=float, default=None, help="each attempt's memory (default: the card's)")
    p.add_argument("--budget-seconds", type=float, default=None, help="no attempt starts that would end past this")
    p.add_argument("--least-s", type=float, default=60.0, help="an attempt's estimated seconds with none before it")
    p.add_argument("--model-root", default=None, help="where the models are written (default: a temp dir)")
    p.add_argument("--tokenizer", default=None, help="directory holding the embedded tokenizer")
    p.add_argument("--record", default=None, help="append the rows to this JSONL file (gpu_grpo.jsonl's)")
    p.add_argument("--json", default=None, help="write the search's report here after each attempt")
    args = p.parse_args(argv)
    args.tools, args.modes = _subset(p, "--tools", args.tools, TOOLS), _subset(p, "--modes", args.modes, MODES)
    args.sizes = _subset(p, "--sizes", args.sizes, tuple(random_llama.SHAPES))
    body = [random_llama.parameter_count(random_llama.SHAPES[s], 0) for s in args.sizes]
    if body != sorted(body) or len(set(body)) != len(body):
        p.error(f"--sizes: expected sizes in increasing order of parameters, got {args.sizes} ({body} without "
                "the embeddings); reorder them")
    if args.memory_cap_mib is not None and args.memory_cap_mib <= 0:
        p.error(f"--memory-cap-mib: expected a positive number of MiB, got {args.memory_cap_mib}")
    args.model_root = args.model_root or tempfile.gettempdir()
    return args


def bench_args(args: argparse.Namespace, size: str, timeout_s: float) -> argparse.Namespace:
    """gpu_grpo.py's arguments for one size: its rows, workload and model directory are reused."""
    argv = ["--model", f"llama-{size}", "--device", args.device, "--dtype", args.dtype, "--prompts",
            str(args.prompts), "--group", str(args.group), "--max-new-tokens", str(args.max_new_tokens),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--timeout", str(max(1.0, min(timeout_s, 3600.0))),
            "--model-dir", os.path.join(args.model_root, f"tether-random-llama-{size}-{args.dtype}")]
    return gpu_grpo.parse_args(argv + (["--tokenizer", args.tokenizer] if args.tokenizer else []))


def fits(figures: dict) -> bool | None:
    """True when the step ran, False when it ran out of memory, None when it failed otherwise."""
    if "error" not in figures:
        return True
    return False if any(marker in figures["error"] for marker in OUT_OF_MEMORY) else None


def attempt(tool: str, mode: str, size: str, bench: argparse.Namespace, model: str, args, run: str,
            card: str) -> dict:
    """One (tool, mode, size) in a fresh process; its gpu_grpo.jsonl row."""
    from e2e_grpo import MODES as LORA, measure

    start = time.monotonic()
    work = {**gpu_grpo.workload(bench, model), "lora": LORA[mode], "memory_cap_mib": args.memory_cap_mib}
    result = measure(tool, work, bench)
    if result.get("detail"):
        print(f"{tool} {mode} {size}:\n{result['detail'][-2000:]}", file=sys.stderr)
    f = gpu_grpo.figures(result)
    row = gpu_grpo.spec_row(run, bench, card, f"{tool}/{mode}", f, bench=BENCH)
    return {**row, "size": size, "fits": fits(f), "error": f.get("error"), "memory_cap_mib": args.memory_cap_mib,
            "parameters": random_llama.parameter_count(random_llama.SHAPES[size], 49152),
            "seconds": time.monotonic() - start}


def estimate(size: str, last: tuple[str, float] | None, least_s: float) -> float:
    """Seconds an attempt at ``size`` should take: the last attempt's, scaled by parameters."""
    if last is None:
        return least_s
    count = lambda s: random_llama.parameter_count(random_llama.SHAPES[s], 49152)  # noqa: E731
    return max(least_s, last[1] * count(size) / count(last[0]))


def save(args: argparse.Namespace, report: dict, row: dict | None = None) -> None:
    if row is not None and args.record:
        import _results

        _results.write(args.record, row, key=gpu_grpo.ROW_KEY)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def search(args: argparse.Namespace, card: str) -> dict:
    """Every tool and mode up the sizes; the report (rows, sizes not started, the largest that fit)."""
    from e2e_grpo import trl_problem

    deadline = time.monotonic() + (args.budget_seconds if args.budget_seconds is not None else float("inf"))
    run = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ}-{BENCH}"
    report: dict = {"run": run, "device": card, "sizes": args.sizes, "rows": [], "not_started": [], "largest": {}}
    climbing = [(t, m) for t in args.tools for m in args.modes]
    if "TRL" in args.tools and (why := trl_problem()):
        report["not_started"] += [{"tool": "TRL", "mode": m, "size": args.sizes[0], "reason": why} for m in args.modes]
        climbing = [c for c in climbing if c[0] != "TRL"]
    last: dict[tuple[str, str], tuple[str, float]] = {}
    for size in args.sizes:
        ready = [c for c in climbing if deadline - time.monotonic() >= estimate(size, last.get(c), args.least_s)]
        report["not_started"] += [{"tool": t, "mode": m, "size": size, "reason": "budget"}
                                  for t, m in climbing if (t, m) not in ready]
        climbing = ready
        if not climbing:
            break
        bench = bench_args(args, size, deadline - time.monotonic())
        try:
            model = gpu_grpo.model_directory(bench)
        except (subprocess.SubprocessError, OSError, RuntimeError) as exc:
            report["not_started"] += [{"tool": t, "mode": m, "size": size, "reason": f"model not built: {exc}"}
                                      for t, m in climbing]
            break
        for tool, mode in list(climbing):
            left = deadline - time.monotonic()
            if left < estimate(size, last.get((tool, mode)), args.least_s):
                report["not_started"].append({"tool": tool, "mode": mode, "size": size, "reason": "budget"})
                climbing.remove((tool, mode))
                continue
            row = attempt(tool, mode, size, bench_args(args, size, left), model, args, run, card)
            last[(tool, mode)] = (size, row["seconds"])
            report["rows"].append(row)
            if row["fits"]:
                report["largest"][f"{tool}/{mode}"] = size
            else:
                climbing.remove((tool, mode))
            save(args, report, row)
    save(args, report)
    return report


def table(report: dict) -> str:
    from _common import markdown_table, mib

    lines = [[r["size"], r["tool"], r["mode"], {True: "yes", False: "no"}.get(r["fits"], "failed"),
              "" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}",
              "" if r["peak_gpu_memory_bytes"] is None else mib(r["peak_gpu_memory_bytes"]), r["error"] or ""]
             for r in report["rows"]]
    return markdown_table(["size", "tool", "mode", "fits", "tokens/s", "peak GPU memory (MiB)", "error"], lines)


def card_name(device: str) -> str:
    """The GPU's name from nvidia-smi (torch's would open a CUDA context here, memory the attempts
    could not have), else torch's; "CPU" on the CPU."""
    if device == "cpu":
        return "CPU"
    try:
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "--id=0"]
        return subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        import torch

        return torch.cuda.get_device_name()


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("largest_model.py: no CUDA GPU visible to torch; --device cpu for a smoke run.")
    report = search(args, card_name(args.device))
    print(f"Largest model a GRPO step runs on, {card}, {args.prompts} x {args.group} x {args.max_new_tokens} "
          f"tokens, {args.dtype}, cap {args.memory_cap_mib or 'none'} MiB\n\n{table(report)}\n")
    print("largest that fits: " + (", ".join(f"{k} {v}" for k, v in report["largest"].items()) or "none"))
    for entry in report["not_started"]:
        print(f"not started: {entry['tool']} {entry['mode']} {entry['size']} ({entry['reason']})")
    return 1 if any(r["fits"] is None for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
