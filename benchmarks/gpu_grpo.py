"""One GRPO optimizer step on a GPU: tether's ``train_step`` against TRL's ``GRPOTrainer``, bf16.

The workload, its equalisation and the timing are ``e2e_grpo.py``'s, both tools in bfloat16
(tether ``dtype=bfloat16``, TRL ``bf16=True``, no vLLM). ``--model``: the embedded
SmolLM2-135M-Instruct, or a Llama-shaped random model (``random_llama.py``: ``llama-1b``,
``llama-3b``, ``llama-8b``, ``llama-tiny`` for CPU smoke runs with ``--device cpu``). Per variant:
median step wall time, tokens/s per GPU as NeMo-RL counts it, the share of the step spent
generating, and the peak GPU memory of a timed step. Targets (issue 28): tether tokens/s >= 1.5x
TRL's, peak GPU memory <= 0.7x. ``--json PATH`` writes the figures after each variant; ``--record
FILE`` appends one row a tool and mode (``benchmarks/results/gpu_grpo.jsonl``'s keys, SPEC
section 13, with ``bench: step``). How each figure is taken: docs/gpu.md, "How it is measured";
its tables are built from those rows (``benchmarks/tables.py``), and figures of earlier sessions
that have no rows are in docs/history/gpu-runs.md.

    .venv-bench/bin/python benchmarks/gpu_grpo.py                          # both tools, both modes
    .venv-bench/bin/python benchmarks/gpu_grpo.py --model llama-1b --steps 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import random_llama  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = {"prompts": 16, "group": 8, "max_new_tokens": 128}
MODELS = ("default", *(f"llama-{size}" for size in random_llama.SHAPES))
TOKENS_TARGET, MEMORY_TARGET = 1.5, 0.7
ROW_KEY = ("run", "model", "tool", "mode")  # a row of gpu_grpo.jsonl replaces the one equal on these
GPUS = 1  # one process on one GPU: NeMo-RL's per-GPU figure divides by this


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", choices=MODELS)
    p.add_argument("--model-dir", default=None, help="where a llama-* model is written (default: a temp dir)")
    p.add_argument("--tokenizer", default=None, help="directory holding the embedded tokenizer (llama-* models)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run of the same code")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--prompts", type=int, default=DEFAULT["prompts"])
    p.add_argument("--group", type=int, default=DEFAULT["group"])
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT["max_new_tokens"])
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant")
    p.add_argument("--modes", default="LoRA,full", help="comma-separated subset of LoRA,full")
    p.add_argument("--no-trl", action="store_true", help="tether rows only")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="both tools recompute each decoder layer's activations in backward (tether's "
                        "gradient_checkpointing, TRL's gradient_checkpointing argument)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before a variant's process is killed")
    p.add_argument("--json", default=None, help="write the figures to this file (after each variant)")
    p.add_argument("--record", default=None, help="append one row a tool and mode to this JSONL file "
                   "(SPEC section 13: benchmarks/results/gpu_grpo.jsonl's keys)")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(args.modes) - {"LoRA", "full"})
    if unknown or args.steps < 1 or args.warmup < 0:
        p.error(f"--modes takes a subset of LoRA,full (got {unknown}); --steps >= 1; --warmup >= 0")
    # e2e_grpo.measure reads these
    args.natural_lengths, args.trl_gradient_checkpointing, args.threads = False, args.gradient_checkpointing, 1
    return args


def model_directory(args: argparse.Namespace) -> str | None:
    """None for the embedded model; else the directory of the random Llama. On a GPU it is built in a
    child process (initialised there; the child's GPU memory is released before any variant starts)."""
    if args.model == "default":
        return None
    size = args.model.removeprefix("llama-")
    out = args.model_dir or os.path.join(tempfile.gettempdir(), f"tether-random-llama-{size}-{args.dtype}")
    if args.device == "cpu":
        tokenizer = random_llama.embedded_tokenizer(args.tokenizer)
        return str(random_llama.build_random_llama(size, out, tokenizer=tokenizer, dtype=args.dtype))
    command = [sys.executable, os.path.join(HERE, "random_llama.py"), "--build", size, "--out", out,
               "--dtype", args.dtype, "--device", args.device]
    if args.tokenizer:
        command += ["--tokenizer", args.tokenizer]
    subprocess.run(command, check=True, timeout=args.timeout)
    return out


def workload(args: argparse.Namespace, model: str | None) -> dict:
    """The child's workload (``e2e_grpo.measure``'s ``work`` less ``lora``) for ``args`` and ``model``."""
    return {"prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens, "threads": 1,
            "steps": args.warmup + args.steps, "natural_lengths": False,
            "trl_gradient_checkpointing": args.gradient_checkpointing,
            "tether_gradient_checkpointing": args.gradient_checkpointing,
            "device": args.device, "dtype": args.dtype, "model": model}


def figures(result: dict) -> dict:
    """One variant's numbers: step time, tokens, tokens/s per GPU, generation share, peak GPU memory."""
    if "error" in result:
        return {"error": result["error"]}
    from e2e_grpo import summarise

    s = summarise(result)
    records = result["records"]
    shares = [r["phases"]["sampling"] / sum(r["phases"].values()) for r in records]
    peaks = [r["gpu_peak"] for r in records if "gpu_peak" in r]
    by_phase = [r["gpu_peak_by_phase"] for r in records if r.get("gpu_peak_by_phase")]
    return {
        "median_step_s": s["wall"], "step_times_s": list(s["times"]), "tokens_per_step": s["tokens"],
        "tokens_per_s_per_gpu": s["tokens_per_s"] / GPUS, "generation_share": statistics.median(shares),
        "mean_completion_tokens": s["completion"], "phases_s": s["phases"],
        "phase_detail_s": s["detail"],  # tether's loss pass split, the budget's copy and readings
        "peak_gpu_memory_bytes": statistics.median(peaks) if peaks else None,
        # where the peak falls: each wrapped phase's largest peak over the timed steps
        "peak_gpu_memory_by_phase_bytes": {name: max(p[name] for p in by_phase if name in p)
                                           for name in sorted({n for p in by_phase for n in p})},
    }


def spec_row(run: str, args: argparse.Namespace, device: str, key: str, f: dict, bench: str = "step") -> dict:
    """One row of ``gpu_grpo.jsonl``: ``run`` names the bench run both tools' rows share, ``bench``
    what ran (``step``: this script; ``largest-model``: ``largest_model.py``'s search)."""
    import _results

    tool, mode = key.split("/")
    return {"run": run, "bench": bench, "model": args.model, "mode": mode.lower(), "tool": tool.lower(), "device": device,
            "dtype": args.dtype, "prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens,
            "gradient_checkpointing": args.gradient_checkpointing, "tokens_per_s": f.get("tokens_per_s_per_gpu"), "peak_gpu_memory_bytes": f.get("peak_gpu_memory_bytes"),
            "phases_s": {**f.get("phases_s", {}), **f.get("phase_detail_s", {})},
            "peak_gpu_memory_by_phase_bytes": f.get("peak_gpu_memory_by_phase_bytes", {}),
            **({"error": f["error"]} if "error" in f else {}), **_results.stamp()}


def ratios(rows: dict) -> dict:
    """tether / TRL per mode with the targets, where both rows ran."""
    out = {}
    for mode in ("LoRA", "full"):
        ours, theirs = rows.get(f"tether/{mode}"), rows.get(f"TRL/{mode}")
        if not ours or not theirs or "error" in ours or "error" in theirs:
            continue
        speed = ours["tokens_per_s_per_gpu"] / theirs["tokens_per_s_per_gpu"]
        entry = {"tokens_per_s": speed, "tokens_per_s_target": TOKENS_TARGET,
                 "tokens_per_s_met": speed >= TOKENS_TARGET}
        if ours["peak_gpu_memory_bytes"] and theirs["peak_gpu_memory_bytes"]:
            memory = ours["peak_gpu_memory_bytes"] / theirs["peak_gpu_memory_bytes"]
            entry.update(peak_gpu_memory=memory, peak_gpu_memory_target=MEMORY_TARGET,
                         peak_gpu_memory_met=memory <= MEMORY_TARGET)
        out[mode] = entry
    return out


def gpu_table(rows: dict) -> str:
    from _common import markdown_table, mib

    lines = []
    for key, f in rows.items():
        tool, mode = key.split("/")
        if "error" in f:
            lines.append([mode, tool, f"failed: {f['error']}", "", "", "", ""])
            continue
        peak = "" if f["peak_gpu_memory_bytes"] is None else mib(f["peak_gpu_memory_bytes"])
        lines.append([mode, tool, f"{f['median_step_s']:.3f}", f"{f['tokens_per_step']:.0f}",
                      f"{f['tokens_per_s_per_gpu']:.0f}", f"{100 * f['generation_share']:.0f}%", peak])
    return markdown_table(["mode", "tool", "median step (s)", "tokens/step", "tokens/s per GPU", "generating",
                           "peak GPU memory (MiB)"], lines)


def main(argv=None) -> None:
    import torch

    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"gpu_grpo.py: torch {torch.__version__} sees no CUDA GPU; run it on a machine with one "
                         "(or --device cpu for a smoke run).")
    from e2e_grpo import MODES, measure, trl_problem

    model = model_directory(args)
    work = workload(args, model)
    card = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    run = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ}-{args.model}"
    report = {"model": args.model, "model_dir": model, "device": card, "dtype": args.dtype, "torch": torch.__version__,
              "prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens,
              "steps": args.steps, "warmup": args.warmup, "gpus": GPUS, "rows": {}, "ratios": {}}
    why_not = None if args.no_trl else trl_problem()
    for mode in args.modes:
        tools = ["tether"] + ([] if args.no_trl else ["TRL"])
        for tool in tools:
            result = ({"error": why_not} if tool == "TRL" and why_not else
                      measure(tool, {**work, "lora": MODES[mode]}, args))
            report["rows"][f"{tool}/{mode}"] = figures(result)
            if args.record:
                import _results

                row = spec_row(run, args, card, f"{tool}/{mode}", report["rows"][f"{tool}/{mode}"])
                _results.write(args.record, row, key=ROW_KEY)
            if result.get("detail"):
                print(f"{tool} ({mode}) failed:\n{result['detail'][-3000:]}", file=sys.stderr)
            report["ratios"] = ratios(report["rows"])
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=1)
    print(f"GRPO optimizer step, {args.model} {args.dtype} on {card}, {args.prompts} prompts x {args.group} answers "
          f"x {args.max_new_tokens} tokens (forced), no vLLM; torch {torch.__version__}; median of {args.steps} "
          f"steps after {args.warmup} warm-up\n")
    print(gpu_table(report["rows"]))
    for key, f in report["rows"].items():
        if f.get("peak_gpu_memory_by_phase_bytes"):
            from _common import mib

            print(f"{key} peak GPU memory by phase (MiB): "
                  + ", ".join(f"{n} {mib(b)}" for n, b in f["peak_gpu_memory_by_phase_bytes"].items()))
    for mode, r in report["ratios"].items():
        memory = (f", peak GPU memory {r['peak_gpu_memory']:.2f}x (target <= {MEMORY_TARGET}x)"
                  if "peak_gpu_memory" in r else "")
        print(f"{mode}: tether/TRL tokens/s {r['tokens_per_s']:.2f}x (target >= {TOKENS_TARGET}x){memory}")


if __name__ == "__main__":
    main()
