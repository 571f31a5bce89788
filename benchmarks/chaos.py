"""Chaos: SIGKILL tiny ``tether train`` runs at random moments; each must resume to the final weights,
byte for byte, of a run that was never stopped.

    python benchmarks/chaos.py --runs 50 [--seed 0] [--steps 4] [--out DIR]

Each run is killed once at a moment drawn from ``MOMENTS``: a uniform delay into the run (``time``),
after a logged step but before the first checkpoint (``before-checkpoint``), while a checkpoint's
files are being written (``checkpoint-write``), or at a uniform delay into the resumed process too
(``resume``). Then it goes on as a user would: ``--resume`` when config.yaml is there (a run with no
checkpoint yet starts again from step 0), else the same command again; until it exits 0. The table
gives each run's moment, what the kill left on disk, the processes it took, and whether the final
policy.safetensors equals the clean run's. Exits 1 when one differs or a run does not finish.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MOMENTS = ("time", "before-checkpoint", "checkpoint-write", "resume")
_POLL_S = 0.0002


@dataclass
class ChaosRun:
    """One killed run: its moment, what the kill left on disk, processes until done, and the verdict."""

    index: int
    moment: str
    left: str
    processes: int
    identical: bool


def tiny_args(out: Path, steps: int, checkpoint_every: int) -> list[str]:
    """``tether train`` key=value words of a tiny run (a few seconds on one core)."""
    cfg = dict(model="tiny", task="arithmetic", steps=steps, out=str(out), prompts_per_step=2, group_size=3,
               max_new_tokens=6, micro_batch_size=4, eval_size=2, eval_max_new_tokens=6, lora_rank=0,
               learning_rate=1e-3, checkpoint_every=checkpoint_every, threads=1)
    return [f"{key}={value}" for key, value in cfg.items()]


def _command(words: list[str]) -> list[str]:
    return [sys.executable, "-m", "tether.train.cli", "train", "--quiet", *words]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}


def run_to_end(words: list[str]) -> int:
    """``tether train words`` in a process of its own; its exit status."""
    return subprocess.run(_command(words), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          check=False).returncode


def _state(run: Path) -> str:
    """What the run directory holds: its checkpoints, a checkpoint being written, the logged steps."""
    root = run / "checkpoints"
    names = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    steps = [n.split("_")[-1].lstrip("0") or "0" for n in names if n.startswith("step_")]
    partial = [n for n in names if n.startswith(".tmp_step_")]
    lines = (run / "metrics.jsonl").read_text().count("\n") if (run / "metrics.jsonl").is_file() else None
    return (f"config={'yes' if (run / 'config.yaml').is_file() else 'no'} logged={lines} "
            f"checkpoints={','.join(steps) or '-'}{' writing=' + partial[0] if partial else ''}")


def _due(moment: str, run: Path, started: float, delay: float) -> bool:
    if moment in ("time", "resume"):
        return time.perf_counter() - started >= delay
    root = run / "checkpoints"
    if moment == "before-checkpoint":
        logged = (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size > 0
        return logged and not root.is_dir()
    return root.is_dir() and any(e.name.startswith(".tmp_step_") for e in os.scandir(root))


def kill_at(words: list[str], run: Path, moment: str, delay: float) -> str:
    """Start ``tether train words`` and SIGKILL it at ``moment`` (``delay`` seconds in, for the
    timed moments); what the kill left on disk, or ``finished`` if the run ended first."""
    proc = subprocess.Popen(_command(words), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = time.perf_counter()
    while proc.poll() is None:
        if _due(moment, run, started, delay):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return _state(run)
        time.sleep(_POLL_S)
    return "finished"


def go_on(words: list[str], run: Path, *, kill_resume: float | None = None, limit: int = 5) -> int:
    """Continue the killed run as a user would until it exits 0; the processes this took. With
    ``kill_resume`` the first resume is killed that many seconds in as well."""
    for attempt in range(1, limit + 1):
        again = ["--resume", str(run)] if (run / "config.yaml").is_file() else words
        if kill_resume is not None and attempt == 1:
            if kill_at(again, run, "time", kill_resume) != "finished":
                continue
            return attempt
        code = run_to_end(again)
        if code == 0:
            return attempt
        if code != 2 or attempt == limit:
            raise RuntimeError(f"{run}: `tether train {' '.join(again)}` exited {code}")
    raise RuntimeError(f"{run}: not finished after {limit} processes")


def final_weights(run: Path, steps: int) -> bytes:
    return (run / "checkpoints" / f"step_{steps:06d}" / "policy.safetensors").read_bytes()


def chaos(runs: int, *, seed: int, steps: int, workdir: Path, moments: tuple[str, ...] = MOMENTS) -> list[ChaosRun]:
    """``runs`` killed runs (moments cycled in order, delays drawn from ``seed``) against one clean run."""
    rng = random.Random(seed)
    clean = workdir / "clean"
    started = time.perf_counter()
    if run_to_end(tiny_args(clean, steps, 1)) != 0:
        raise RuntimeError(f"the clean run in {clean} failed")
    duration, want = time.perf_counter() - started, final_weights(clean, steps)
    out = []
    for index in range(runs):
        moment, run = moments[index % len(moments)], workdir / f"run{index:03d}"
        # before-checkpoint needs a logged step without a checkpoint: every other step is checkpointed
        words = tiny_args(run, steps, 2 if moment == "before-checkpoint" else 1)
        left = kill_at(words, run, moment, rng.uniform(0, duration))
        processes = 1 + (0 if left == "finished" else go_on(
            words, run, kill_resume=rng.uniform(0, duration) if moment == "resume" else None))
        out.append(ChaosRun(index, moment, left, processes, final_weights(run, steps) == want))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="", help="Keep the run directories here (default: a temporary one).")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.out or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        records = chaos(args.runs, seed=args.seed, steps=args.steps, workdir=workdir)
    print(f"{'run':>4} {'moment':18} {'processes':>9} {'identical':>9}  left by the kill")
    for r in records:
        print(f"{r.index:>4} {r.moment:18} {r.processes:>9} {str(r.identical):>9}  {r.left}")
    same = sum(r.identical for r in records)
    print(f"{same} of {len(records)} runs ended with the clean run's final weights, byte for byte")
    return 0 if same == len(records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
