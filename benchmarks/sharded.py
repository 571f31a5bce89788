"""The sharded learner on CPU: time per step and peak memory per rank, 1 rank against 2.

Each row runs ``tether.train.recipe.train_step`` on ``build_run`` under ``torch.distributed.run``
with N processes (gloo, FSDP2; N = 1 is the plain one-process path) on a fixed workload, with the
rollout ``tether train --nproc N`` steps with (``recipe_sharded.rank_rollout``): one warm-up step,
then the timed ones. Each rank reports the median wall time of its timed steps (the row shows the
slowest rank's) and the mean seconds of its stages, its resident-set high-water mark over the timed steps
(``VmHWM``, restarted after the warm-up through ``/proc/self/clear_refs``) and over its life
(``resource.getrusage``: model loading included), and its RSS right after importing torch and
tether (the libraries' share, the same in every process). Why 2 ranks cannot beat 1 on a CPU
and what sharding buys there: docs/scaling.md, "A sharded learner (FSDP2)".

A run writes one record per rank count to ``benchmarks/results/sharded.jsonl`` (``--results DIR``
elsewhere; a ``--quick`` run, the tiny model for 2 steps, only when given); ``table`` builds the
scaling page's table from the newest record of each (fine-tuning, ranks, threads).

    python benchmarks/sharded.py                          # LoRA rank 16, 1 and 2 ranks
    python benchmarks/sharded.py --lora-rank 0            # full fine-tuning
    python benchmarks/sharded.py --ranks 1 --threads 2    # one process on both cores (and --lora-rank 0)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
SRC = str(HERE.parents[1] / "src")
sys.path.insert(0, str(HERE.parent))
import _results  # noqa: E402

# Timed apart in each rank's step: sampling, the reference pass, the loss pass with the optimizer step,
# the budget's readings of the kept weights, and the rollout (on 2+ ranks: gathering the weights, the
# sampling and the reference pass; on one, the sampling alone).
STAGES = ("rollout", "sample", "add_reference", "optimize", "hold_kl_budget")
COMMANDS = ("python benchmarks/sharded.py", "python benchmarks/sharded.py --lora-rank 0",
            "python benchmarks/sharded.py --ranks 1 --threads 2",
            "python benchmarks/sharded.py --ranks 1 --threads 2 --lora-rank 0")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def worker(args: argparse.Namespace) -> None:
    """One rank: build the run, one warm-up step, then the timed steps; append this rank's record."""
    import time

    import torch  # noqa: F401  (the libraries' RSS is read before the model exists)

    from step_clock import PhaseClock
    from step_profile import staged
    from tether.train import recipe
    from tether.train.config import TrainConfig
    from tether.train.recipe_sharded import rank_rollout

    libraries = _rss_mib()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = TrainConfig(model=args.model, lora_rank=args.lora_rank, steps=args.steps, out=args.out,
                      prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=args.max_new_tokens,
                      micro_batch_size=args.micro_batch, threads=args.threads, nproc=world).validate()
    run, clock = recipe.build_run(cfg), PhaseClock()
    staged(recipe, clock.wrap, STAGES[1:])
    rollout = clock.wrap("rollout", rank_rollout(recipe) if world > 1 else recipe.sample)  # as `tether train --nproc N`
    recipe.train_step(run, 0, rollout)
    clock.reset()
    with open("/proc/self/clear_refs", "w") as f:  # restart the high-water mark: the timed steps' own peak
        f.write("5")
    times = []
    for step in range(1, args.steps):
        start = time.perf_counter()
        recipe.train_step(run, step, rollout)
        times.append(time.perf_counter() - start)
    record = {"rank": int(os.environ.get("RANK", "0")), "step_s": statistics.median(times),
              "steps_peak_mib": _hwm_mib(), "life_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "libraries_mib": libraries, "stage_s": {k: v / len(times) for k, v in clock.seconds.items()}}
    with open(args.report, "a") as f:
        f.write(json.dumps(record) + "\n")


def measure(args: argparse.Namespace, ranks: int) -> dict:
    """Run the workload on ``ranks`` processes; the logged step times and each rank's memory."""
    from tether.train.launch import free_port

    with tempfile.TemporaryDirectory() as folder:
        report, out = os.path.join(folder, "ranks.jsonl"), os.path.join(folder, "run")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(HERE), "--worker",
               "--report", report, "--out", out, *_workload_flags(args)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": str(args.threads)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{ranks} rank(s) failed:\n{done.stderr[-4000:]}")
        per_rank = sorted((json.loads(line) for line in Path(report).read_text().splitlines()),
                          key=lambda r: r["rank"])
    return {"step_s": max(r["step_s"] for r in per_rank), "ranks": per_rank}


def _measured(args: argparse.Namespace, ranks: int) -> dict:
    """``measure``'s result, or ``{"error": ...}`` naming why the ranks failed (the row is recorded so)."""
    from _common import child_error

    try:
        return measure(args, ranks)
    except RuntimeError as exc:
        return {"error": child_error(exc)}


def _workload_flags(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--lora-rank", str(args.lora_rank), "--steps", str(args.steps),
            "--prompts", str(args.prompts), "--group", str(args.group), "--max-new-tokens",
            str(args.max_new_tokens), "--micro-batch", str(args.micro_batch), "--threads", str(args.threads)]


def records(args: argparse.Namespace, results: dict[int, dict], run: str, versions: dict, command: str) -> list[dict]:
    """One record per rank count of this invocation: the workload, the slowest rank's median step
    and each rank's figures as ``measure`` gave them."""
    workload = {"model": args.model, "lora_rank": args.lora_rank, "threads": args.threads, "steps": args.steps,
                "prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens,
                "micro_batch": args.micro_batch, "dtype": "float32", "quick": args.quick, "command": command}
    return [{"run": run, "ranks": n, **workload, "step_s": result.get("step_s"), "per_rank": result.get("ranks", []),
             **({"error": result["error"]} if "error" in result else {}), **versions, **_results.stamp()}
            for n, result in results.items()]


def newest(rows: list[dict]) -> list[dict]:
    """The newest full record of each (fine-tuning, ranks, threads): LoRA first, then by ranks, threads."""
    kept: dict[tuple, dict] = {}
    for r in sorted((r for r in rows if not r.get("quick")), key=lambda r: r["run"]):
        kept[(r["lora_rank"], r["ranks"], r["threads"])] = r
    return [kept[k] for k in sorted(kept, key=lambda k: (k[0] == 0, k[1], k[2]))]


def table(rows: list[dict]) -> str:
    """The scaling page's table from the records: the newest of each row (``newest``)."""
    rows = newest(rows)
    if not rows:
        return ("No run of `benchmarks/sharded.py` is recorded yet: on an idle machine, "
                + ", ".join(f"`{c}`" for c in COMMANDS)
                + " record the rows and `python benchmarks/tables.py` builds this table.")
    return render(rows)


def render(rows: list[dict]) -> str:
    """One line per record (fine-tuning, ranks x threads, each rank's memory), then the workload and
    where, when and how the rows ran."""
    lines = ["| fine-tuning | ranks x threads | s / step (median, slowest rank) | rank 0's step: gather / sample / "
             "reference / loss + optimizer / readings (s, mean) | peak RSS per rank, timed steps (MiB) "
             "| peak RSS per rank, process life (MiB) | of which libraries (MiB) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        def each(key: str) -> str:
            return " / ".join(f"{rank[key]:.0f}" for rank in r["per_rank"])

        kind = f"LoRA r{r['lora_rank']}" if r["lora_rank"] else "full"
        if r.get("error"):
            lines.append(f"| {kind} | {r['ranks']} x {r['threads']} | failed: {r['error']} | | | | |")
            continue
        lines.append(f"| {kind} | {r['ranks']} x {r['threads']} | {r['step_s']:.2f} | {stages(r['per_rank'][0], r['ranks'])} "
                     f"| {each('steps_peak_mib')} "
                     f"| {each('life_peak_mib')} | {each('libraries_mib')} |")
    first = rows[0]
    stamps = "; ".join(sorted({f"{r['machine']}, {r['date']}, commit {r['commit']}, torch {r.get('torch')}" for r in rows}))
    return ("\n".join(lines) + f"\n\nModel {first['model']}, {first['dtype']}, {first['prompts']} prompts x "
            f"{first['group']} answers x {first['max_new_tokens']} tokens, median of steps 2-{first['steps']} after one "
            f"warm-up step; {stamps}; " + ", ".join(f"`{c}`" for c in dict.fromkeys(r["command"] for r in rows)) + ".")


def stages(rank: dict, ranks: int) -> str:
    """One rank's stage seconds. On 2+ ranks the gathering is what the rollout took beyond its sampling
    and reference pass (the weights' gather and release); one rank gathers nothing. A record from
    before the split says so."""
    if "stage_s" not in rank:
        return "not recorded"
    s = rank["stage_s"]
    gather = s["rollout"] - s["sample"] - s["add_reference"] if ranks > 1 else 0.0
    return " / ".join(f"{v:.2f}" for v in (gather, s["sample"], s["add_reference"], s["optimize"], s["hold_kl_budget"]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M) or 'tiny'")
    p.add_argument("--lora-rank", type=int, default=16, help="0 fine-tunes every weight")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is not timed")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (a multiple of every rank count)")
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts to run")
    p.add_argument("--quick", action="store_true", help="the tiny model for 2 steps: a smoke run")
    p.add_argument("--results", type=Path, default=None,
                   help=f"write sharded.jsonl here (default {_results.RESULTS}; a --quick run only when given)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.model, args.steps = "tiny", 2
    run, destination = _results.run_id(), _results.destination(args.results, args.quick)
    results = {n: _measured(args, n) for n in (int(n) for n in args.ranks.split(","))}
    rows = records(args, results, run, _results.versions("torch"), _results.command(__file__, argv))
    print(render(rows))
    for row in rows if destination is not None else []:
        _results.write("sharded", row, key=("run", "ranks"), root=destination)


if __name__ == "__main__":
    main()
