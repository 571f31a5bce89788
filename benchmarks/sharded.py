"""The sharded learner on CPU: time per step and peak memory per rank, 1 rank against 2.

Each row runs ``tether.train.recipe.train`` under ``torch.distributed.run`` with N processes
(gloo, FSDP2; N = 1 is the plain one-process path) on a fixed workload, and each rank reports
its resident-set high-water mark (``resource.getrusage``: model loading, evaluation and every
step included) and the RSS right after importing torch and tether (the libraries' share, the
same in every process). The step time is the median ``step_time`` of the steps after the
first, as logged by rank 0, so it covers sampling, rewards, reference, loss and optimizer.

On a machine with fewer cores than ranks x threads, 2 ranks cannot be faster than 1: they
split the same cores and add the gathers and reduce-scatters. What sharding buys on CPU is
memory per rank: each rank holds half the trainable weights, gradients and optimizer state,
and half the batch's activations. The rollout, reference and KL passes gather the whole
weights (``tether.train.sharding``), so a rank's peak still includes one full copy of the
weights during them.

Usage: ``python benchmarks/sharded.py [--model default --lora-rank 16 | --model tiny --lora-rank 0]``.
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


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(args: argparse.Namespace) -> None:
    """One rank: train, then append this rank's memory to ``args.report``."""
    import torch  # noqa: F401  (the libraries' RSS is read before the model exists)

    from tether.train.config import TrainConfig
    from tether.train.recipe import train

    libraries = _rss_mib()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = TrainConfig(model=args.model, lora_rank=args.lora_rank, steps=args.steps, out=args.out,
                      prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=args.max_new_tokens,
                      micro_batch_size=args.micro_batch, eval_size=2, eval_max_new_tokens=4, threads=args.threads,
                      checkpoint_every=0, nproc=world, overwrite=True).validate()
    train(cfg, progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    with open(args.report, "a") as f:
        f.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "peak_mib": peak, "libraries_mib": libraries})
                + "\n")


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
            raise SystemExit(f"{ranks} rank(s) failed:\n{done.stderr[-4000:]}")
        records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
        per_rank = sorted((json.loads(line) for line in Path(report).read_text().splitlines()),
                          key=lambda r: r["rank"])
    return {"step_s": statistics.median(r["step_time"] for r in records[1:]), "ranks": per_rank}


def _workload_flags(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--lora-rank", str(args.lora_rank), "--steps", str(args.steps),
            "--prompts", str(args.prompts), "--group", str(args.group), "--max-new-tokens",
            str(args.max_new_tokens), "--micro-batch", str(args.micro_batch), "--threads", str(args.threads)]


def table(results: dict[int, dict]) -> str:
    lines = ["| ranks | s / step (median) | peak RSS per rank (MiB) | of which libraries (MiB) |",
             "|---|---|---|---|"]
    for n, result in results.items():
        peaks = "/".join(f"{r['peak_mib']:.0f}" for r in result["ranks"])
        libs = "/".join(f"{r['libraries_mib']:.0f}" for r in result["ranks"])
        lines.append(f"| {n} | {result['step_s']:.2f} | {peaks} | {libs} |")
    return "\n".join(lines)


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
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    import torch

    counts = [int(n) for n in args.ranks.split(",")]
    results = {n: measure(args, n) for n in counts}
    kind = "LoRA rank " + str(args.lora_rank) if args.lora_rank else "full fine-tuning"
    print(f"GRPO step, model {args.model} ({kind}), float32 on CPU, {args.prompts} prompts x {args.group} answers, "
          f"max {args.max_new_tokens} new tokens, micro-batch {args.micro_batch}, {args.threads} torch thread(s) per "
          f"rank, torch {torch.__version__}, {os.cpu_count()} CPU cores; steps 2..{args.steps}\n")
    print(table(results))


if __name__ == "__main__":
    main()
