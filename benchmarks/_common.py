"""Shared benchmark plumbing: time a callable in a fresh process and measure its memory.

Every measured variant runs in its own interpreter so that one variant's allocator state
(freed-but-kept arenas, page-cache warmth, torch's thread pools) cannot flatter or penalise
the next. A benchmark module exposes a *setup* function ``setup(**kwargs) -> callable``:
the setup builds the inputs, and only calls of the returned zero-argument callable are
timed and counted for memory.

Memory is the steady state of a training loop: the baseline is the resident set after the
warm-up calls (psutil when installed, ``/proc/self/statm`` otherwise), so one-time library
initialisation is not charged to the variant, and whatever a call returns or leaves behind
must be released by the callable itself to be counted afresh on each call. The peak comes
from the kernel's high-water mark (``VmHWM``), reset at the baseline by writing ``5`` to
``/proc/self/clear_refs``; where that is not possible the fallback is
``resource.getrusage`` (``ru_maxrss``), whose peak also covers setup and warm-up.

Times are wall-clock (``perf_counter``) and, because the machines these run on are often
shared, also process CPU time (all threads), which other processes disturb far less.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

_RESULT_TAG = "BENCH_RESULT "


@dataclass(frozen=True)
class Measurement:
    """Median wall and CPU time of the timed calls and peak resident-set growth."""

    median_s: float
    times_s: tuple[float, ...]
    cpu_median_s: float
    peak_rss_growth_bytes: int
    peak_source: str


def measure_in_subprocess(
    module_path: str,
    setup_name: str,
    kwargs: dict,
    *,
    repeats: int = 3,
    warmup: int = 1,
    timeout_s: float | None = None,
    python: str | None = None,
) -> Measurement:
    """Run ``setup_name(**kwargs)`` from the file ``module_path`` in a new interpreter.

    The returned callable is called ``warmup`` times untimed, then ``repeats`` times timed.
    ``kwargs`` must be JSON-serialisable. ``python`` is the interpreter (default: this one;
    another virtual environment where a variant needs packages this one lacks). Raises
    ``RuntimeError`` with the child's stderr when the child fails.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    spec = {
        "module_path": os.path.abspath(module_path),
        "setup_name": setup_name,
        "kwargs": kwargs,
        "repeats": repeats,
        "warmup": warmup,
    }
    proc = subprocess.run(
        [python or sys.executable, os.path.abspath(__file__), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"benchmark child {setup_name}({kwargs}) failed with exit code "
            f"{proc.returncode}:\n{proc.stderr[-4000:]}"
        )
    data = json.loads(lines[-1][len(_RESULT_TAG) :])
    return Measurement(
        median_s=data["median_s"],
        times_s=tuple(data["times_s"]),
        cpu_median_s=data["cpu_median_s"],
        peak_rss_growth_bytes=data["peak_rss_growth_bytes"],
        peak_source=data["peak_source"],
    )


def child_error(exc: BaseException) -> str:
    """What a failed measurement records: the last exception line the child printed (from
    ``measure_in_subprocess``'s ``RuntimeError``), else its last line, else the error's type; a
    timeout by its limit (its message is the whole command line)."""
    if isinstance(exc, subprocess.TimeoutExpired):
        return f"timed out after {exc.timeout:g} s"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]]
    return (errors[-1] if errors else lines[-1] if lines else type(exc).__name__)[:300]


def cap_memory(cap_mib: float | None, device: str) -> None:
    """Hold this process to ``cap_mib`` MiB of new memory from here on (None: no cap), so that a
    larger model fails as it would on a smaller card: on CUDA through the caching allocator's
    per-process fraction of the card (``torch.OutOfMemoryError`` past it), on the CPU through
    ``RLIMIT_DATA`` set to the private memory held now plus the cap (torch's CPU allocator then
    raises "can't allocate memory"). Call it after the imports, before the model loads."""
    if cap_mib is None:
        return
    if cap_mib <= 0:
        raise ValueError(f"cap_mib: expected a positive number of MiB or None, got {cap_mib}.")
    import torch

    if device == "cuda":
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        if cap_mib * 2**20 > total:
            raise ValueError(f"cap_mib: {cap_mib} MiB is more than this card's {total / 2**20:.0f} MiB; "
                             "give a smaller cap or none.")
        torch.cuda.set_per_process_memory_fraction(cap_mib * 2**20 / total)
        return
    import resource

    with open("/proc/self/status") as f:
        held = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    resource.setrlimit(resource.RLIMIT_DATA, (held + int(cap_mib * 2**20), hard))


def unleashed_step(run, step: int):
    """One step's update with nothing after it (no leash, no logging): sample, reward, reference,
    advantage, optimize. Returns the step's record, for benches that probe the leash on it."""
    from tether.train.recipe import add_advantages, add_reference, add_rewards, optimize, sample, step_problems

    problems = step_problems(run, step)
    record = sample(run, problems, step)
    add_rewards(run, record, problems, step)
    add_reference(run, record)
    add_advantages(run, record)
    optimize(run, record, step)
    return record


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def met(ratio: float, target: float, higher_is_better: bool = False) -> bool:
    """Whether a tether / peer ``ratio`` meets its ``target`` (a floor where higher is better)."""
    return ratio >= target if higher_is_better else ratio <= target


def verdict(ratio: float, target: float, higher_is_better: bool = False) -> str:
    """``'met (<= 0.5x)'`` or ``'missed (>= 2x)'``: the ratio against its target, the direction named."""
    return f"{'met' if met(ratio, target, higher_is_better) else 'missed'} ({'>=' if higher_is_better else '<='} {target:g}x)"


def mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.1f}"


# ---------------------------------------------------------------------------------------
# Child side.


def _current_rss() -> int:
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return psutil.Process().memory_info().rss
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss(reset_ok: bool) -> tuple[int, str]:
    if reset_ok:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "VmHWM"
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return (peak if sys.platform == "darwin" else peak * 1024), "ru_maxrss"


def _child(spec: dict) -> None:
    module_spec = importlib.util.spec_from_file_location("_bench_target", spec["module_path"])
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # dataclasses look their module up there
    module_spec.loader.exec_module(module)
    fn = getattr(module, spec["setup_name"])(**spec["kwargs"])
    for _ in range(spec["warmup"]):
        fn()
    gc.collect()
    baseline = _current_rss()
    reset_ok = _reset_peak()
    times, cpu_times = [], []
    for _ in range(spec["repeats"]):
        start, cpu_start = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    peak, source = _peak_rss(reset_ok)
    result = {
        "median_s": statistics.median(times),
        "times_s": times,
        "cpu_median_s": statistics.median(cpu_times),
        "peak_rss_growth_bytes": max(peak - baseline, 0),
        "peak_source": source,
    }
    print(_RESULT_TAG + json.dumps(result), flush=True)


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
