"""Label log-probs from hidden states: tether's chunked path against full-logit baselines.

Shapes default to the embedded SmolLM2-135M model (H=576, V=49152) on a batch of 16
sequences of 256 tokens, float32, random data with a fixed seed. Variants:

- ``naive``: ``F.linear`` -> ``log_softmax`` -> ``gather`` on the full ``[B, T, V]`` logits;
- ``tether``: ``tether.ops.token_logprobs_from_hidden`` (never builds full logits);
- ``trl``: ``F.linear`` then TRL's ``selective_log_softmax`` (only if ``trl`` imports).

Each variant runs forward-only (under ``no_grad``) and forward+backward (gradients to the
hidden states and the head weight) in a fresh process. Targets for tether: time at most
1.1x naive and extra peak memory at most 0.1x naive. What to expect: the forward does the
same GEMM as naive with far less memory traffic; forward+backward does four GEMMs of the
logits' size where naive does three (the backward recomputes each chunk's logits instead of
keeping them), so on a GEMM-bound CPU it lands near 1.1-1.2x naive time. A full run records
each variant x pass in ``results/logprobs.jsonl`` (``--results``; ``--quick`` only when given).

    python benchmarks/logprobs.py                 # full table (several minutes on 2 cores)
    python benchmarks/logprobs.py --quick         # small smoke run
    python benchmarks/logprobs.py --chunk-sizes 256,512,1024,2048   # one tether row each
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _results  # noqa: E402
from _common import Measurement, child_error, markdown_table, measure_in_subprocess, mib, verdict  # noqa: E402

FULL = {"batch": 16, "tokens": 256, "vocab": 49152, "hidden_size": 576}
QUICK = {"batch": 2, "tokens": 64, "vocab": 4096, "hidden_size": 64}
MODES = ("forward", "forward+backward")
TIME_TARGET, MEMORY_TARGET = 1.1, 0.1
ROW_KEY = ("run", "mode", "variant")  # a row of logprobs.jsonl replaces the one equal on these
COMMAND = ".venv-bench/bin/python benchmarks/logprobs.py"


def _naive(chunk_size):
    def run(hidden, weight, labels):
        logits = F.linear(hidden, weight).float()
        return logits.log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)

    return run


def _tether(chunk_size):
    from tether.ops import token_logprobs_from_hidden

    def run(hidden, weight, labels):
        return token_logprobs_from_hidden(hidden, weight, labels, chunk_size=chunk_size)

    return run


def _trl(chunk_size):
    from trl.trainer.utils import selective_log_softmax

    def run(hidden, weight, labels):
        return selective_log_softmax(F.linear(hidden, weight), labels)

    return run


IMPLEMENTATIONS = {"naive": _naive, "tether": _tether, "trl": _trl}


def setup_variant(impl, mode, batch, tokens, vocab, hidden_size, chunk_size, seed):
    """Build inputs for one variant and return the zero-argument callable to time."""
    torch.manual_seed(seed)
    hidden = torch.randn(batch, tokens, hidden_size)
    # Scaled so logits have unit variance, as a trained head's roughly do.
    weight = torch.randn(vocab, hidden_size) / hidden_size**0.5
    labels = torch.randint(vocab, (batch, tokens))
    fn = IMPLEMENTATIONS[impl](chunk_size)
    if mode == "forward":

        def run():
            with torch.no_grad():
                fn(hidden, weight, labels)

        return run
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    upstream = torch.randn(batch, tokens)

    def run():
        fn(hidden, weight, labels).backward(upstream)
        # Release the gradients inside the call so that every call allocates (and the
        # memory figure counts) them: they are outputs both variants must produce.
        hidden.grad, weight.grad = None, None

    return run


def _trl_available() -> bool:
    if importlib.util.find_spec("trl") is None:
        return False
    try:
        from trl.trainer.utils import selective_log_softmax  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "skip the variant"
        return False
    return True


def _variants(chunk_sizes) -> list[tuple[str, str, int, str | None]]:
    """(label, implementation, chunk size, why it cannot run or None) in table order; naive first."""
    rows = [("naive", "naive", 0, None)]
    rows += [(f"tether (chunk {c})", "tether", c, None) for c in chunk_sizes]
    rows.append(("trl selective_log_softmax", "trl", 0, None if _trl_available() else "trl does not import"))
    return rows


def measured_row(mode: str, label: str, impl: str, chunk_size: int, m: Measurement) -> dict:
    """One variant x pass's figures from its measurement."""
    return {"mode": mode, "variant": label, "impl": impl, "chunk_size": chunk_size, "median_s": m.median_s,
            "times_s": list(m.times_s), "cpu_median_s": m.cpu_median_s,
            "peak_rss_growth_bytes": m.peak_rss_growth_bytes, "peak_source": m.peak_source}


def measure_rows(shapes, chunk_sizes, args) -> list[dict]:
    """One row a pass x variant: its figures, ``skipped`` where trl does not import, ``error``
    where the variant's process failed."""
    rows = []
    for mode in MODES:
        for label, impl, chunk, skip in _variants(chunk_sizes):
            row = {"mode": mode, "variant": label, "impl": impl, "chunk_size": chunk}
            if skip:
                rows.append({**row, "skipped": skip})
                continue
            kwargs = dict(impl=impl, mode=mode, chunk_size=chunk, seed=0, **shapes)
            try:
                m = measure_in_subprocess(__file__, "setup_variant", kwargs, repeats=args.repeats, warmup=args.warmup)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                rows.append({**row, "error": child_error(error)})
                continue
            rows.append(measured_row(mode, label, impl, chunk, m))
    return rows


def _ratio_cells(r: dict, base: dict | None) -> list[str]:
    """median s, time / naive, CPU time / naive, peak MiB, memory / naive and tether's verdicts."""
    if "median_s" not in r:
        return ["not installed" if "skipped" in r else "failed", "", "", "", "", "", ""]
    cells = [f"{r['median_s']:.3f}", "", "", mib(r["peak_rss_growth_bytes"]), "", "", ""]
    if base is None or "median_s" not in base:
        return cells
    t = r["median_s"] / base["median_s"]
    memory = r["peak_rss_growth_bytes"] / max(base["peak_rss_growth_bytes"], 1)
    cells[1:3] = [f"{t:.2f}x", f"{r['cpu_median_s'] / base['cpu_median_s']:.2f}x"]
    cells[4] = f"{memory:.3f}x"
    if r["impl"] == "tether":
        cells[5:] = [verdict(t, TIME_TARGET), verdict(memory, MEMORY_TARGET)]
    return cells


def ratio_table(rows: list[dict]) -> str:
    """Each pass x variant, its ratios to the naive row of the same pass (rows of one run)."""
    naive = {r["mode"]: r for r in rows if r["impl"] == "naive"}
    lines = [[r["mode"], r["variant"], *_ratio_cells(r, naive.get(r["mode"]))] for r in rows]
    headers = ["mode", "implementation", "median wall time (s)", "time / naive", "CPU time / naive",
               "peak RSS growth (MiB)", "memory / naive", "time target", "memory target"]
    return markdown_table(headers, lines)


def table(records: list[dict]) -> str:
    """The docs' table: the newest full (not ``--quick``) run's rows, and where and how it ran."""
    rows = _results.newest_run(records)
    if not rows:
        return f"No full run is recorded yet: `{COMMAND}` records one in `benchmarks/results/logprobs.jsonl`."
    r = rows[0]
    versions = ", ".join(f"{k} {r[k]}" for k in ("torch", "trl") if r.get(k))
    return (ratio_table(rows) + f"\n\nRun {r['run']}: {r['machine']}, commit {r['commit']}, {r['date']}; "
            f"B={r['batch']} T={r['tokens']} V={r['vocab']} H={r['hidden_size']}, {r['dtype']}, "
            f"{r['threads']} threads, median of {r['repeats']} after {r['warmup']} warm-up; {versions}; "
            f"`{r['command']}`.")


def parse_args(argv=None) -> argparse.Namespace:
    from tether.ops.logprobs import DEFAULT_CHUNK_SIZE

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes for a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per variant (default 3, quick 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per variant")
    parser.add_argument("--chunk-sizes", default=str(DEFAULT_CHUNK_SIZE),
                        help="comma-separated tether chunk sizes, one table row each (default: the default)")
    parser.add_argument("--results", type=Path, default=None,
                        help=f"write logprobs.jsonl here (default {_results.RESULTS}; a --quick run only when given)")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 5 if args.quick else 3
    args.results = _results.destination(args.results, args.quick)
    text = args.chunk_sizes
    args.chunk_sizes = [int(c) for c in text.split(",") if c.strip().isdigit() and int(c) > 0]
    if len(args.chunk_sizes) != len(text.split(",")):
        parser.error(f"--chunk-sizes: expected comma-separated positive integers such as 512,1024, got {text!r}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    shapes, results, chunk_sizes = QUICK if args.quick else FULL, args.results, args.chunk_sizes
    run = _results.run_id()
    print(f"label log-probs, float32, B={shapes['batch']} T={shapes['tokens']} V={shapes['vocab']} "
          f"H={shapes['hidden_size']}, torch {torch.__version__}, {torch.get_num_threads()} threads; median of "
          f"{args.repeats} after {args.warmup} warm-up, each variant in a fresh process; memory is the peak RSS "
          "growth over the post-warm-up steady state, gradients included\n")
    rows = measure_rows(shapes, chunk_sizes, args)
    print(ratio_table(rows))
    if results is None:
        return rows
    workload = {"run": run, "quick": args.quick, **shapes, "dtype": "float32", "threads": torch.get_num_threads(),
                "repeats": args.repeats, "warmup": args.warmup, "torch": torch.__version__,
                "trl": _results.version("trl"),
                "command": _results.command(__file__, argv), **_results.stamp()}
    for row in rows:
        _results.write("logprobs", {**workload, **row}, ROW_KEY, root=results)
    print(f"\n{len(rows)} records in {Path(results) / 'logprobs.jsonl'}")
    return rows


if __name__ == "__main__":
    main()
