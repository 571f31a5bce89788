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
keeping them), so on a GEMM-bound CPU it lands near 1.1-1.2x naive time.

    python benchmarks/logprobs.py                 # full table (several minutes on 2 cores)
    python benchmarks/logprobs.py --quick         # small smoke run
    python benchmarks/logprobs.py --chunk-sizes 256,512,1024,2048   # one tether row each
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import markdown_table, measure_in_subprocess, mib  # noqa: E402

FULL = {"batch": 16, "tokens": 256, "vocab": 49152, "hidden_size": 576}
QUICK = {"batch": 2, "tokens": 64, "vocab": 4096, "hidden_size": 64}
MODES = ("forward", "forward+backward")
TIME_TARGET, MEMORY_TARGET = 1.1, 0.1


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


def _measure(impl, mode, chunk_size, shapes, args):
    kwargs = dict(impl=impl, mode=mode, chunk_size=chunk_size, seed=0, **shapes)
    return measure_in_subprocess(
        __file__, "setup_variant", kwargs, repeats=args.repeats, warmup=args.warmup
    )


def _verdict(ratio: float, target: float) -> str:
    return f"{'met' if ratio <= target else 'missed'} (<= {target}x)"


def _variants(chunk_sizes):
    """(label, implementation, chunk size) rows in table order; naive first."""
    rows = [("naive", "naive", 0)]
    rows += [(f"tether (chunk {c})", "tether", c) for c in chunk_sizes]
    if _trl_available():
        rows.append(("trl selective_log_softmax", "trl", 0))
    return rows


def run_table(shapes, chunk_sizes, args) -> str:
    rows = []
    for mode in MODES:
        results = [
            (label, impl, _measure(impl, mode, chunk, shapes, args))
            for label, impl, chunk in _variants(chunk_sizes)
        ]
        base = results[0][2]
        for label, impl, m in results:
            t_ratio = m.median_s / base.median_s
            cpu_ratio = m.cpu_median_s / base.cpu_median_s
            m_ratio = m.peak_rss_growth_bytes / max(base.peak_rss_growth_bytes, 1)
            targets = ["", ""]
            if impl == "tether":
                targets = [_verdict(t_ratio, TIME_TARGET), _verdict(m_ratio, MEMORY_TARGET)]
            rows.append(
                [
                    mode,
                    label,
                    f"{m.median_s:.3f}",
                    f"{t_ratio:.2f}x",
                    f"{cpu_ratio:.2f}x",
                    mib(m.peak_rss_growth_bytes),
                    f"{m_ratio:.3f}x",
                    *targets,
                ]
            )
    headers = [
        "mode",
        "implementation",
        "median wall time (s)",
        "time / naive",
        "CPU time / naive",
        "peak RSS growth (MiB)",
        "memory / naive",
        "time target",
        "memory target",
    ]
    return markdown_table(headers, rows)


def main(argv=None) -> None:
    from tether.ops.logprobs import DEFAULT_CHUNK_SIZE

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes for a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per variant")
    parser.add_argument(
        "--chunk-sizes",
        default=str(DEFAULT_CHUNK_SIZE),
        help="comma-separated tether chunk sizes, one table row each (default: the default)",
    )
    args = parser.parse_args(argv)
    shapes = QUICK if args.quick else FULL
    if args.repeats is None:
        args.repeats = 5 if args.quick else 3
    chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
    print(
        f"label log-probs, float32, B={shapes['batch']} T={shapes['tokens']} "
        f"V={shapes['vocab']} H={shapes['hidden_size']}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; median of {args.repeats} after "
        f"{args.warmup} warm-up, each variant in a fresh process; memory is the peak RSS "
        "growth over the post-warm-up steady state, gradients included\n"
    )
    print(run_table(shapes, chunk_sizes, args))


if __name__ == "__main__":
    main()
