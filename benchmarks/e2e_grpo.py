"""One GRPO optimizer step end to end: ``tether train``'s step against TRL's ``GRPOTrainer``.

Times a whole optimizer step (sample, reward, score the reference, advantages, loss forward and
backward by micro-batch, gradient clip, AdamW) on the embedded SmolLM2-135M-Instruct (float32,
CPU) and the ``arithmetic`` task, LoRA and full fine-tuning, each tool and mode in a fresh
process: one untimed warm-up step, then the median of K. tether's side is ``setup_tether`` here,
TRL's is ``e2e_trl.py``. Per row: step time, CPU time, tokens/s, mean completion length, peak
RSS (timed steps and process life), tether/TRL ratios against the targets (tokens/s >= 1.2x,
peak memory <= 0.7x), and a table of phases. What both tools share, where they still differ, the
default size and the thread count: docs/performance.md, "How it is measured".
A full run writes one row a tool and mode to ``benchmarks/results/e2e_grpo.jsonl`` (``--results
DIR`` elsewhere; a ``--quick`` run only there); ``e2e_tables.py`` builds the page's tables.

    .venv-bench/bin/python benchmarks/e2e_grpo.py              # both tools, both modes (~10 min)
    .venv-bench/bin/python benchmarks/e2e_grpo.py --quick      # 2 x 2 x 4 tokens, 1 timed step
    .venv-bench/bin/python benchmarks/e2e_grpo.py --no-trl     # tether rows only
    .venv/bin/python benchmarks/e2e_grpo.py                    # tether only (no TRL there)
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

# Everything is local: the embedded model is a directory on disk and nothing is downloaded.
for _flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_flag, "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _results  # noqa: E402
from _common import cap_memory, child_error, markdown_table, measure_in_subprocess, met, mib, verdict  # noqa: E402
from step_clock import PhaseClock, append_step, memory_peaks  # noqa: E402

FULL = {"prompts": 4, "group": 4, "max_new_tokens": 16}
QUICK = {"prompts": 2, "group": 2, "max_new_tokens": 4}
TOKENS_TARGET = 1.2  # tether tokens/s >= this x TRL's
MEMORY_TARGET = 0.7  # tether peak RSS (timed steps) <= this x TRL's
MODES = {"LoRA": True, "full": False}
TOOLS = {"tether": "tether", "TRL": "trl"}  # as printed -> as recorded (gpu_grpo.jsonl's spelling, SPEC section 13)
DISPLAY = {"tether": "tether", "trl": "TRL", "lora": "LoRA", "full": "full"}  # as recorded -> as printed
NAME = "e2e_grpo"  # benchmarks/results/e2e_grpo.jsonl
ROW_KEY = ("run", "tool", "mode")  # a row replaces the one equal on these
PHASES = ("sampling", "scoring", "loss", "optimizer")
PHASE_TITLES = {
    "sampling": "sampling",
    "scoring": "rewards + reference + advantages",
    "loss": "loss forward + backward",
    "optimizer": "clip + optimizer step + rest",
}
TOKENS_DEFINITION = (
    "tokens/s = non-pad prompt + completion tokens of the step's prompts x group sequences, "
    "divided by the step's wall time"
)


# ------------------------------------------------------------------ shared workload
def train_config(work: dict, out: str = "runs/bench-e2e"):
    """tether's ``TrainConfig`` for the workload (everything else at its defaults)."""
    from tether.train.config import TrainConfig

    base = TrainConfig()
    values = {
        "prompts_per_step": work["prompts"],
        "group_size": work["group"],
        "max_new_tokens": work["max_new_tokens"],
        "micro_batch_size": micro_batch(work["prompts"] * work["group"], base.micro_batch_size),
        "threads": work["threads"],
        "steps": work["steps"],
        "out": out,
        # TRL's beta is constant: the default budget leash's readings of the updated weights
        # (tether's own work, measured in docs/leash.md) would be timed against nothing.
        "kl_controller": "constant",
    }
    if not work["lora"]:
        values["lora_rank"] = 0
    if work.get("tether_gradient_checkpointing"):  # benchmarks/gpu_grpo.py --gradient-checkpointing: both tools
        values["gradient_checkpointing"] = True
    if "device" in work:  # benchmarks/gpu_grpo.py: the same workload on a GPU
        values.update(device=work["device"], dtype=work["dtype"])
    if work.get("model"):  # benchmarks/gpu_grpo.py --model: a model directory instead of the embedded one
        values["model"] = work["model"]
    return base.override(values).validate()


def micro_batch(batch: int, limit: int) -> int:
    """The largest divisor of ``batch`` not above ``limit``: TRL needs whole micro-batches."""
    return max(d for d in range(1, min(batch, limit) + 1) if batch % d == 0)


def step_problems(cfg, n_steps: int) -> list:
    """The problems of steps ``0 .. n_steps - 1``, as ``tether.train.recipe.rollout`` draws them."""
    from tether.train.tasks import load_task

    task = load_task(cfg.task)
    excluded = {p.key for p in task.eval_set(cfg.eval_size)}
    return [task.train_problem(cfg.seed, i, excluded) for i in range(n_steps * cfg.prompts_per_step)]


# ------------------------------------------------------------------ tether
def setup_tether(work: dict, info_path: str):
    """One ``train_step`` per call on ``build_run(train_config(work))``."""
    import torch

    from tether.train import recipe

    folder = tempfile.TemporaryDirectory()
    cap_memory(work.get("memory_cap_mib"), work.get("device", "cpu"))  # largest_model.py's smaller card
    run = recipe.build_run(train_config(work, out=folder.name))
    if not work["natural_lengths"]:
        run.sampler.eos_ids = {-1}  # no token id matches: every answer runs to max_new_tokens
    clock = PhaseClock()
    # train_step looks the stages up in the module at call time (the rollout is its argument),
    # so wrapping them times each phase.
    sample = clock.wrap("sampling", recipe.sample)
    recipe.add_rewards = clock.wrap("rewards", recipe.add_rewards)
    recipe.add_reference = clock.wrap("reference", recipe.add_reference)
    recipe.accumulate_gradients = clock.wrap("loss", recipe.accumulate_gradients)
    # inside "loss" (forward; the rest of it is backward) and after it: where the peak falls
    recipe.token_terms = clock.wrap("loss_forward", recipe.token_terms)
    recipe.optimize = clock.wrap("optimizer", recipe.optimize)
    recipe.mark_step_start = clock.wrap("budget_start", recipe.mark_step_start)
    recipe.hold_kl_budget = clock.wrap("readings", recipe.hold_kl_budget)
    counter = itertools.count()

    def step() -> None:
        clock.reset()
        start = time.perf_counter()
        recipe.train_step(run, next(counter), sample)
        if run.models.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        record = clock.last["sampling"]
        seconds = clock.seconds
        phases = {
            "sampling": seconds["sampling"],
            "scoring": seconds["rewards"] + seconds["reference"],
            "loss": seconds["loss"],
        }
        phases["optimizer"] = wall - sum(phases.values())
        detail = {name: seconds.get(name, 0.0) for name in ("loss_forward", "budget_start", "readings")}
        detail["loss_backward"] = seconds["loss"] - detail["loss_forward"]
        detail["optimizer_step"] = seconds["optimizer"] - seconds["loss"]  # clip and the step
        completion = record.assistant_mask.sum(-1).float()
        append_step(info_path, {
            "tokens": int(record.attention_mask.sum()),
            "mean_completion": float(completion.mean()),
            "phases": phases,
            "phase_detail": detail,
            "threads": torch.get_num_threads(),
            **memory_peaks(clock),
        })

    step.keep_alive = folder  # the run directory lives as long as the callable
    return step


# ------------------------------------------------------------------ driver
def trl_problem() -> str | None:
    """Why TRL cannot run in this environment, or None."""
    missing = [name for name in ("trl", "datasets", "peft") if importlib.util.find_spec(name) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (run with .venv-bench/bin/python)"
    return None


def measure(tool: str, work: dict, args) -> dict:
    """One (tool, mode) in a fresh process: timing from ``_common`` plus the logged step records."""
    path, setup = {"tether": (__file__, "setup_tether"), "TRL": (os.path.join(HERE, "e2e_trl.py"), "setup_trl")}[tool]
    with tempfile.TemporaryDirectory() as folder:
        info_path = os.path.join(folder, "steps.jsonl")
        try:
            m = measure_in_subprocess(path, setup, {"work": work, "info_path": info_path},
                                      repeats=args.steps, warmup=args.warmup, timeout_s=args.timeout)
        except Exception as exc:  # noqa: BLE001 - reported in the table instead of aborting the run
            return {"error": child_error(exc), "detail": str(exc)}
        with open(info_path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    timed = records[args.warmup:]
    return {"m": m, "records": timed}


def summarise(result: dict) -> dict:
    m, records = result["m"], result["records"]
    tokens = statistics.median(r["tokens"] for r in records)
    return {
        "wall": m.median_s,
        "times": m.times_s,
        "cpu": m.cpu_median_s,
        "tokens": tokens,
        "tokens_per_s": tokens / m.median_s,
        "completion": statistics.mean(r["mean_completion"] for r in records),
        "peak": records[-1]["hwm"],
        "lifetime": records[-1]["ru_maxrss"],
        "phases": {p: statistics.median(r["phases"][p] for r in records) for p in PHASES},
        # tether's split of its phases (loss forward / backward, the leash's readings); TRL has none
        "detail": {name: statistics.median(r["phase_detail"][name] for r in records)
                   for name in (records[0].get("phase_detail") or {})},
        "threads": sorted({r["threads"] for r in records}),
    }


def label(row: dict) -> str:
    """A row's mode as the tables print it, with what its run changed from the default workload."""
    extra = [name for key, name in (("natural_lengths", "natural lengths"),
                                    ("trl_gradient_checkpointing", "TRL checkpointing")) if row.get(key)]
    return DISPLAY[row["mode"]] + (f" ({', '.join(extra)})" if extra else "")


def settings(args: argparse.Namespace, work: dict, micro_batch_size: int) -> dict:
    """The workload and library versions every row of one invocation records."""
    import torch

    return {"model": "default", "device": "CPU", "dtype": "float32", "prompts": work["prompts"], "group": work["group"],
            "max_new_tokens": work["max_new_tokens"], "micro_batch_size": micro_batch_size, "threads": work["threads"],
            "natural_lengths": work["natural_lengths"], "trl_gradient_checkpointing": work["trl_gradient_checkpointing"],
            "steps": args.steps, "warmup": args.warmup, "quick": args.quick, "torch": torch.__version__,
            **_results.versions("trl", "transformers", "peft")}


def record(run: str, tool: str, mode: str, setup: dict, result: dict) -> dict:
    """One row of ``e2e_grpo.jsonl``: ``summarise``'s figures of one (tool, mode), raw, with the
    run's ``setup`` (``settings``) and the machine's stamp; a failed variant keeps its ``error``."""
    row = {"run": run, "tool": TOOLS[tool], "mode": mode.lower(), **setup}
    if "error" in result:
        return {**row, "error": result["error"], **_results.stamp()}
    s = summarise(result)
    return {**row, "median_step_s": s["wall"], "step_times_s": list(s["times"]), "cpu_s": s["cpu"],
            "tokens_per_step": s["tokens"], "tokens_per_s": s["tokens_per_s"], "mean_completion_tokens": s["completion"],
            "peak_rss_bytes": s["peak"], "lifetime_rss_bytes": s["lifetime"], "phases_s": s["phases"],
            "phase_detail_s": s["detail"],
            # VmHWM: the timed steps' peak; ru_maxrss where the kernel's counter could not be reset (process life)
            "peak_rss_source": result["m"].peak_source, "threads_seen": s["threads"], **_results.stamp()}


def ratios(ours: dict | None, theirs: dict | None) -> tuple[float, float] | None:
    """tether / TRL tokens/s and peak RSS (timed steps) of two rows of one run; None unless both ran."""
    if not ours or not theirs or "error" in ours or "error" in theirs:
        return None
    return ours["tokens_per_s"] / theirs["tokens_per_s"], ours["peak_rss_bytes"] / theirs["peak_rss_bytes"]


def main_table(rows: list[dict]) -> str:
    """One line a row (``record``'s), the tether line with its ratios to TRL's row of the same mode."""
    by = {(r["tool"], r["mode"]): r for r in rows}
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([label(r), DISPLAY[r["tool"]], f"failed: {r['error']}"] + [""] * 9)
            continue
        line = [label(r), DISPLAY[r["tool"]], f"{r['median_step_s']:.2f}", " ".join(f"{t:.2f}" for t in r["step_times_s"]),
                f"{r['cpu_s']:.2f}", f"{r['tokens_per_step']:.0f}", f"{r['mean_completion_tokens']:.1f}",
                f"{r['tokens_per_s']:.1f}", mib(r["peak_rss_bytes"]), mib(r["lifetime_rss_bytes"])]
        both = ratios(r, by.get(("trl", r["mode"]))) if r["tool"] == "tether" else None
        line += ([f"{both[0]:.2f}x {verdict(both[0], TOKENS_TARGET, True)}",
                  f"{both[1]:.2f}x {verdict(both[1], MEMORY_TARGET, False)}"] if both else ["", ""])
        lines.append(line)
    headers = ["mode", "tool", "median step (s)", "step times (s)", "median CPU (s)", "tokens/step",
               "mean completion (tokens)", "tokens/s", "peak RSS, timed steps (MiB)", "peak RSS, process life (MiB)",
               "tokens/s tether/TRL", "peak RSS tether/TRL"]
    return markdown_table(headers, lines)


def phase_table(rows: list[dict]) -> str:
    """Median seconds a step per phase and its share of the step, one line a row that ran; and of
    the last phase, what tether's leash spent reading the kept weights (``kl_bound``; TRL has none)."""
    lines = []
    for r in rows:
        if "error" in r:
            continue
        total = sum(r["phases_s"].values())
        readings = r.get("phase_detail_s", {}).get("readings")
        lines.append([label(r), DISPLAY[r["tool"]]]
                     + [f"{r['phases_s'][p]:.2f} ({100 * r['phases_s'][p] / total:.0f}%)" for p in PHASES]
                     + ["" if readings is None else f"{readings:.2f}"])
    return markdown_table(["mode", "tool"] + [f"{PHASE_TITLES[p]} (s)" for p in PHASES]
                          + ["of which the leash's reading of the kept weights (s)"], lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 prompts x 2 answers x 4 tokens, 1 timed step")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps per variant (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps per variant")
    parser.add_argument("--prompts", type=int, default=None, help=f"prompts per step (default {FULL['prompts']})")
    parser.add_argument("--group", type=int, default=None, help=f"answers per prompt (default {FULL['group']})")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"completion limit (default {FULL['max_new_tokens']})")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every variant")
    parser.add_argument("--no-trl", action="store_true", help="tether rows only")
    parser.add_argument("--natural-lengths", action="store_true",
                        help="let answers end at end-of-turn instead of forcing max-new-tokens tokens")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="TRL with gradient checkpointing (its GRPOConfig default; tether has none)")
    parser.add_argument("--modes", default="LoRA,full", help="comma-separated subset of LoRA,full")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before a variant's process is killed")
    parser.add_argument("--results", default=None, metavar="DIR",
                        help=f"write one row a tool and mode to DIR/{NAME}.jsonl (default: benchmarks/results; "
                             "a --quick run records only where DIR is given)")
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (1 if args.quick else 3)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or args.steps < 1 or args.warmup < 0:
        parser.error(f"--modes takes a subset of {sorted(MODES)} (got {unknown}); --steps >= 1; --warmup >= 0")
    return args


def results_dir(args: argparse.Namespace):
    """Where the rows go (``_results.destination``: a quick run without ``--results`` records nothing)."""
    return _results.destination(args.results, args.quick)


def main(argv=None) -> list[dict]:
    import torch

    args = parse_args(argv)
    size = QUICK if args.quick else FULL
    work = {
        "prompts": args.prompts or size["prompts"],
        "group": args.group or size["group"],
        "max_new_tokens": args.max_new_tokens or size["max_new_tokens"],
        "threads": args.threads,
        "steps": args.warmup + args.steps,
        "natural_lengths": args.natural_lengths,
        "trl_gradient_checkpointing": args.trl_gradient_checkpointing,
    }
    cfg = train_config({**work, "lora": True})
    results = results_dir(args)
    print(
        f"GRPO optimizer step end to end, SmolLM2-135M-Instruct float32 on CPU, task {cfg.task}: "
        f"{work['prompts']} prompts x {work['group']} answers, max {work['max_new_tokens']} new tokens "
        f"({'natural lengths' if work['natural_lengths'] else 'lengths forced to the limit'}), micro-batch "
        f"{cfg.micro_batch_size}, lr {cfg.learning_rate}, beta {cfg.kl_coef}, temperature {cfg.temperature}; "
        f"torch {torch.__version__}, {args.threads} thread(s); median of {args.steps} steps after {args.warmup} warm-up\n"
    )
    started = time.perf_counter()
    run = _results.run_id()
    setup = settings(args, work, cfg.micro_batch_size)
    why_not = None if args.no_trl else trl_problem()
    rows, failures = [], []
    for mode in args.modes:
        for tool in ["tether"] + ([] if args.no_trl else ["TRL"]):
            result = ({"error": why_not, "detail": ""} if tool == "TRL" and why_not else
                      measure(tool, {**work, "lora": MODES[mode]}, args))
            rows.append(record(run, tool, mode, setup, result))
            if results is not None:  # after each variant: a later failure keeps the rows before it
                _results.write(NAME, rows[-1], key=ROW_KEY, root=results)
            if result.get("detail"):
                failures.append(f"\n{tool} ({mode}) failed:\n{result['detail'][-3000:]}")
    print(main_table(rows))
    print(f"\n{TOKENS_DEFINITION}. Peak RSS: the process's resident-set high-water mark over the timed "
          "steps (reset after the warm-up) and over its whole life (model loading included). Targets: "
          f"tether tokens/s >= {TOKENS_TARGET}x TRL, peak RSS (timed steps) <= {MEMORY_TARGET}x TRL.")
    print("\nPhases (median seconds per step, share of the step):\n")
    print(phase_table(rows))
    threads = sorted({t for r in rows if "error" not in r for t in r["threads_seen"]})
    print(f"\ntorch threads seen inside the steps: {threads}; whole run {time.perf_counter() - started:.0f} s")
    if results is not None:
        print(f"rows of run {run} written to {os.path.join(results, NAME + '.jsonl')}")
    if failures:
        print("".join(failures))
    return rows


if __name__ == "__main__":
    main()
