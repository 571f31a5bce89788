"""docs/gpu.md's tables from the GPU records: ``gpu_check.jsonl`` (a stage of gpu_check.py a line)
and ``gpu_grpo.jsonl`` (gpu_grpo.py's steps and largest_model.py's search, SPEC section 13).

Only rows recorded on a GPU count (dry runs and ``--device cpu`` smoke rows are left out). A
ratio is only taken between rows of one run (the same card and session); the largest-model table
pairs rows of one card and memory cap, newest first, and names the runs it read.
``benchmarks/tables.py`` writes them into the page; with no rows a table says which command
records them.
"""

from __future__ import annotations

from typing import Any, Callable

import _results

PAGE = "docs/gpu.md"
CHECKS = ("cuda-tests", "train", "parity", "nccl")
PHASES = ("sampling", "scoring", "loss", "loss_forward", "loss_backward", "optimizer", "optimizer_step", "readings")
COPY = "then append the call's `$OUT/results/*.jsonl` to their namesakes in `benchmarks/results/`"
UNRECORDED = " The 2026-11-26/27 H200 figures have no record: [GPU runs, by date](history/gpu-runs.md)."


def _mib(n: float | None) -> str:
    return "" if n is None else f"{n / 2**20:,.0f}"


def _on_gpu(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("device") not in (None, "CPU") and not r.get("dry_run")]


def _newest(rows: list[dict[str, Any]], key: Callable[[dict], tuple]) -> dict[tuple, dict[str, Any]]:
    """The last row of each key (records are appended in time order)."""
    out: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        out[key(r)] = r
    return out


def _check_result(stage: str, f: dict[str, Any]) -> str:
    if stage == "cuda-tests":
        return f"{f['passed']} passed, {f['failed']} failed, {f['skipped']} skipped"
    if stage == "train":
        return (f"{f['wall_s']:.0f} s wall; held-out accuracy {100 * f['accuracy_before']:.1f} % → "
                f"{100 * f['accuracy_after']:.1f} % ({f['accuracy_gain_points']:+.1f} points); held-out KL "
                f"{f['eval_kl_per_seq']:.2f} nats per answer; {f['steps_over_kl_bound']} steps over `kl_bound`")
    if stage == "parity":
        e = f["bf16_vs_float64"]
        return (f"log-prob error mean {e['logprob_mean_abs']:.3f}, largest {e['logprob_max_abs']:.2f} nats; summed "
                f"KL relative error {e['kl_sum_rel']:.1e}; within tolerance: {'yes' if f['within_tolerance'] else 'no'}")
    return (f"{f['backend']}, {f['world_size']} rank(s): loss and {f['parameters_compared']} gradients match the "
            f"unsharded model: {'yes' if f['matches_unsharded'] else 'no'}")


def checks(records: list[dict[str, Any]]) -> str:
    """The newest GPU record of each check stage."""
    newest = _newest([r for r in _on_gpu(records) if r["stage"] in CHECKS], lambda r: (r["stage"],))
    if not newest:
        return ("No GPU check is recorded yet. The stages `cuda-tests`, `train`, `parity` and `nccl` of "
                "`bash benchmarks/gpu_check.sh` record them in `$OUT/results/gpu_check.jsonl`; " + COPY + "."
                + UNRECORDED)
    lines = ["| check | status | result | device | date, commit |", "|---|---|---|---|---|"]
    for stage in CHECKS:
        if (stage,) not in newest:
            lines.append(f"| {stage} | not recorded | | | |")
            continue
        r = newest[(stage,)]
        result = _check_result(stage, r["figures"]) if r["status"] == "ran" else r.get("reason") or ""
        lines.append(f"| {stage} | {r['status']} | {result} | {r['device']} | {r['date']}, {r['commit']} |")
    return "\n".join(lines)


def _model(r: dict[str, Any]) -> str:
    """The model, and whether both tools recomputed activations (``gpu_grpo.py --gradient-checkpointing``)."""
    return r["model"] + (" (checkpointing)" if r.get("gradient_checkpointing") else "")


def _step_runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of each model's newest step run on a GPU, with and without activation checkpointing."""
    steps = [r for r in _on_gpu(rows) if r.get("bench", "step") == "step"]
    newest_run = {_model(r): r["run"] for r in steps}
    return [r for r in steps if r["run"] == newest_run[_model(r)]]


def steps(rows: list[dict[str, Any]]) -> str:
    """tether against TRL per model and mode, from each model's newest run."""
    chosen = _step_runs(rows)
    if not chosen:
        return ("No GPU step is recorded yet in `benchmarks/results/gpu_grpo.jsonl` (`bash benchmarks/gpu_check.sh "
                "--stages install,bench-llama-1b`, or `python benchmarks/gpu_grpo.py --record FILE`; " + COPY + ")."
                + UNRECORDED)
    by = _newest(chosen, lambda r: (_model(r), r["mode"], r["tool"]))
    lines = ["| model | mode | tokens/s, tether / TRL | tether ÷ TRL | peak GPU memory (MiB), tether / TRL "
             "| tether ÷ TRL | device | date, commit |", "|---|---|---|---|---|---|---|---|"]
    for model, mode in sorted({(m, mo) for m, mo, _ in by}):
        ours, theirs = by.get((model, mode, "tether"), {}), by.get((model, mode, "trl"), {})

        def cell(r: dict, key: str, fmt: Callable[[float], str]) -> str:
            return "not run" if not r else f"failed: {r['error']}" if r.get("error") else fmt(r[key]) if r[key] else ""

        speed = (f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}×"
                 if ours.get("tokens_per_s") and theirs.get("tokens_per_s") else "")
        memory = (f"{ours['peak_gpu_memory_bytes'] / theirs['peak_gpu_memory_bytes']:.2f}×"
                  if ours.get("peak_gpu_memory_bytes") and theirs.get("peak_gpu_memory_bytes") else "")
        any_row = ours or theirs
        lines.append(f"| {model} | {mode} | {cell(ours, 'tokens_per_s', '{:,.0f}'.format)} / "
                     f"{cell(theirs, 'tokens_per_s', '{:,.0f}'.format)} | {speed} | "
                     f"{cell(ours, 'peak_gpu_memory_bytes', _mib)} / {cell(theirs, 'peak_gpu_memory_bytes', _mib)} "
                     f"| {memory} | {any_row['device']} | {any_row['date']}, {any_row['commit']} |")
    return "\n".join(lines)


def phases(rows: list[dict[str, Any]]) -> str:
    """Seconds a step by phase, the rows of ``steps``' runs (a phase a tool does not split is blank)."""
    chosen = sorted(_step_runs(rows), key=lambda r: (_model(r), r["mode"], r["tool"]))
    if not chosen:
        return "No GPU step is recorded yet: the phases come with the step rows above."
    present = [p for p in PHASES if any(p in r.get("phases_s", {}) for r in chosen)]
    lines = ["| model | mode | tool | " + " | ".join(present) + " |", "|---|---|---|" + "---|" * len(present)]
    for r in chosen:
        cells = [f"{r['phases_s'][p]:.2f}" if p in r.get("phases_s", {}) else "" for p in present]
        lines.append(f"| {_model(r)} | {r['mode']} | {r['tool']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _largest_cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "not tried"
    if r["fits"] is False:
        return "does not fit: " + r["error"][:90]
    if r["fits"] is None:
        return "failed: " + (r["error"] or "")[:90]
    peak = r["peak_gpu_memory_bytes"]
    return f"{r['tokens_per_s']:,.0f} tokens/s" + ("" if peak is None else f", {_mib(peak)} MiB")


def largest(rows: list[dict[str, Any]]) -> str:
    """Per card and memory cap, each size tether and TRL tried: fits, tokens/s, peak memory, ratios."""
    found = [r for r in _on_gpu(rows) if r.get("bench") == "largest-model"]
    if not found:
        return ("No largest-model search is recorded yet (`bash benchmarks/gpu_check.sh --stages install,largest-model "
                "--largest-tools tether`, then `--largest-tools TRL`; " + COPY + ").")
    by = _newest(found, lambda r: (r["device"], r.get("memory_cap_mib"), r["mode"], r["size"], r["tool"]))
    lines = ["| card (memory cap) | mode | size | tether | TRL | tokens/s, tether ÷ TRL | peak memory, tether ÷ TRL |",
             "|---|---|---|---|---|---|---|"]
    order = {s: r["parameters"] for s, r in ((r["size"], r) for r in found)}
    for card, cap, mode, size in sorted({k[:4] for k in by}, key=lambda k: (k[0], k[1] or 0, k[2], order[k[3]])):
        ours, theirs = by.get((card, cap, mode, size, "tether")), by.get((card, cap, mode, size, "trl"))
        both = ours and theirs and ours["fits"] and theirs["fits"]
        speed = f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}×" if both else ""
        memory = (f"{ours['peak_gpu_memory_bytes'] / theirs['peak_gpu_memory_bytes']:.2f}×"
                  if both and ours["peak_gpu_memory_bytes"] and theirs["peak_gpu_memory_bytes"] else "")
        where = card + (f" ({cap:,.0f} MiB)" if cap else "")
        lines.append(f"| {where} | {mode} | {size} | {_largest_cell(ours)} | {_largest_cell(theirs)} | {speed} "
                     f"| {memory} |")
    runs = sorted({(r["run"], r["commit"], r["prompts"], r["group"], r["max_new_tokens"]) for r in by.values()})
    return "\n".join(lines) + "\n\nRuns: " + "; ".join(
        f"{run} (commit {c}, {p} × {g} × {t} tokens)" for run, c, p, g, t in runs) + "."


TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "gpu-checks": (PAGE, lambda: checks(_results.read("gpu_check"))),
    "gpu-steps": (PAGE, lambda: steps(_results.read("gpu_grpo"))),
    "gpu-phases": (PAGE, lambda: phases(_results.read("gpu_grpo"))),
    "largest-model": (PAGE, lambda: largest(_results.read("gpu_grpo"))),
}
