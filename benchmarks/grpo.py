"""GRPOLoss forward+backward on the embedded SmolLM2-135M-Instruct: tether against TorchRL.

Times a full ``forward + backward`` of each variant on one batch of 16 chats (4 arithmetic
prompts x 4 answers), each variant in a fresh interpreter (``_common``): wall and process-CPU
seconds, and the step footprint (the peak resident set of the timed calls over the one at the
end of setup) beside ``_common``'s growth over the post-warm-up state. Variants: ``tether``
(``tether.objectives.GRPOLoss``, KL to the reference and entropy bonus on), ``tether x4`` (the
same loss over 4 micro-batches with the full batch's denominator) and ``torchrl``
(``torchrl.objectives.llm.GRPOLoss``, only where torchrl imports: ``.venv-bench``). How the
batch is built and what each variant runs: docs/performance.md, "How it is measured". Targets
for tether: at most 0.5x TorchRL's time and 0.35x its step footprint. A full run records one row
a variant in ``benchmarks/results/grpo_loss.jsonl`` (``--results DIR`` elsewhere; a ``--quick``
run records only there); ``table`` builds docs/performance.md's ``grpo-loss`` from them.

    .venv-bench/bin/python benchmarks/grpo.py            # full table (several minutes), recorded
    .venv-bench/bin/python benchmarks/grpo.py --quick    # short answers, one timed run
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _results  # noqa: E402
from _common import child_error, markdown_table, measure_in_subprocess, mib, verdict  # noqa: E402

SYSTEM = "You are a helpful assistant. Show your reasoning, then give the number."
WORDS = (
    "first we add the tens then the units and carry one so the sum is clear because each "
    "digit counts and we check the result twice before we write the final answer here"
).split()
FULL = {"min_words": 40, "max_words": 190}
QUICK = {"min_words": 4, "max_words": 16}
TIME_TARGET, MEMORY_TARGET = 0.5, 0.35
KL_COEFF, ENTROPY_COEFF = 0.1, 0.01


def make_chats(min_words: int, max_words: int, seed: int = 0):
    """16 chats (4 prompts x 4 answers), their rewards and prompt group ids."""
    rng = random.Random(seed)
    chats, rewards, groups = [], [], []
    for prompt in range(4):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        for _ in range(4):
            answer = a + b + rng.choice([0, 0, 1, -10])
            reasoning = " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
            chats.append([
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is {a}+{b}?"},
                {"role": "assistant", "content": f"{reasoning}. {a} + {b} = {answer}."},
            ])
            rewards.append(float(answer == a + b))
            groups.append(prompt)
    return chats, torch.tensor(rewards), torch.tensor(groups)


def _perturbed(log_probs, tokens, attention, mask):
    """(sampling, reference) log-probs: deterministic functions of token id and position in
    the row, so both libraries get the same values whatever their padding side."""
    position = (attention.long().cumsum(-1) - 1).to(log_probs.dtype)
    ids = tokens.to(log_probs.dtype)
    sampled = log_probs + 0.02 * torch.sin(ids + 7 * position)
    ref = log_probs - 0.05 - 0.03 * torch.cos(ids + 3 * position)
    zero = torch.zeros_like(log_probs)
    return torch.where(mask, sampled, zero), torch.where(mask, ref, zero)


def _tether_batch(model, tokenizer, size):
    from tensordict import TensorDict

    from tether.models import TransformersWrapper
    from tether.models.batch_io import write_objects
    from tether.objectives import MCAdvantage

    chats, rewards, groups = make_chats(**size)
    actor = TransformersWrapper(model, tokenizer, input_mode="history", generate=False)
    td = TensorDict(batch_size=[len(chats)])
    write_objects(td, ("history", "full"), chats)
    with torch.no_grad():
        actor(td)
    mask = td["masks", "all_assistant_mask"] & td["masks", "all_attention_mask"]
    sampled, ref = _perturbed(td["log_probs", "full"], td["tokens", "full"], td["masks", "all_attention_mask"], mask)
    td["log_probs", "full"], td["ref_log_probs", "full"] = sampled, ref
    td["advantage"] = MCAdvantage(4).compute(rewards, groups)
    return actor, td


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_logged(run, rss_log: str | None):
    """``run`` that also appends the resident set before each call to the file ``rss_log``,
    after a first line with the resident set at the end of setup."""
    if rss_log is None:
        return run
    gc.collect()
    with open(rss_log, "w") as f:
        f.write(f"{_rss()}\n")

    def logged():
        with open(rss_log, "a") as f:
            f.write(f"{_rss()}\n")
        run()

    return logged


def setup_tether(size: dict, micro_batches: int = 1, rss_log: str | None = None):
    """Zero-argument callable: tether GRPOLoss forward+backward over ``micro_batches`` parts."""
    from tether.models import load_default_model
    from tether.objectives import GRPOLoss
    from tether.ops import aggregate_denominator

    model, tokenizer = load_default_model()
    actor, td = _tether_batch(model, tokenizer, size)
    loss = GRPOLoss(actor, kl_to_ref_coeff=KL_COEFF, entropy_coeff=ENTROPY_COEFF)
    mask = td["masks", "all_assistant_mask"]
    denominator = aggregate_denominator(mask, loss.aggregation)
    parts = torch.arange(td.shape[0]).chunk(micro_batches)

    def run():
        for rows in parts:
            loss(td[rows], denominator=denominator).total_loss().backward()
        model.zero_grad(set_to_none=True)

    return _rss_logged(run, rss_log)


def setup_torchrl(size: dict, rss_log: str | None = None):
    """Zero-argument callable: TorchRL GRPOLoss forward+backward on the same chats."""
    from tensordict import TensorDict
    from torchrl.data.llm import History
    from torchrl.modules.llm import TransformersWrapper as TorchRLWrapper
    from torchrl.modules.llm.policies import ChatHistory
    from torchrl.objectives.llm import GRPOLoss as TorchRLGRPOLoss

    from tether.models import load_default_model
    from tether.objectives import MCAdvantage

    model, tokenizer = load_default_model()
    chats, rewards, groups = make_chats(**size)
    actor = TorchRLWrapper(model, tokenizer=tokenizer, input_mode="history", generate=False,
                           return_log_probs=True, pad_output=True)
    td = TensorDict(batch_size=[len(chats)])
    td["history"] = ChatHistory(full=History.from_chats(chats))
    with torch.no_grad():
        actor(td)
    attention, mask = td["masks", "all_attention_mask"], td["masks", "all_assistant_mask"]
    sampled, ref = _perturbed(td["log_probs", "full"], td["tokens", "full"], attention, mask)
    td["log_probs", "full"] = sampled
    td["next", "ref_log_probs", "full"] = ref
    advantage = MCAdvantage(4).compute(rewards, groups)
    # TorchRL wants the advantage with the log-weight's [B, T, 1] shape.
    td["advantage"] = advantage[:, None, None].expand(*mask.shape, 1).clone()
    loss = TorchRLGRPOLoss(actor, kl_to_ref_coeff=KL_COEFF, entropy_bonus=True, entropy_coeff=ENTROPY_COEFF,
                           masking_strategy="rlhf")

    def run():
        out = loss(td)
        sum(value for key, value in out.items() if key.startswith("loss_") and value is not None).backward()
        model.zero_grad(set_to_none=True)

    return _rss_logged(run, rss_log)


def _torchrl_available() -> bool:
    if importlib.util.find_spec("torchrl") is None:
        return False
    try:
        from torchrl.objectives.llm import GRPOLoss  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "skip the variant"
        return False
    return True


VARIANTS = {
    "tether": ("setup_tether", {"micro_batches": 1}),
    "tether x4": ("setup_tether", {"micro_batches": 4}),
    "torchrl": ("setup_torchrl", {}),
}


def _measure(name: str, size: dict, args) -> tuple:
    """(Measurement, step footprint in bytes) of one variant in a fresh process.

    ``_common`` reports the peak growth over the resident set *after* the warm-up calls, so
    memory a call allocates and the allocator keeps for the next call is not in it. The step
    footprint adds it back: the peak of the timed calls over the resident set at the end of
    setup (model loaded, batch built), i.e. what one training step needs.
    """
    setup, extra = VARIANTS[name]
    with tempfile.TemporaryDirectory() as folder:
        log = os.path.join(folder, "rss.txt")
        m = measure_in_subprocess(
            __file__, setup, {"size": size, "rss_log": log, **extra}, repeats=args.repeats, warmup=args.warmup
        )
        with open(log) as f:
            rss = [int(line) for line in f if line.strip()]
    after_setup, before_timed = rss[0], rss[1 + args.warmup]
    return m, before_timed + m.peak_rss_growth_bytes - after_setup


def record(run: str, name: str, result, size: dict, args, command: str) -> dict:
    """One row of ``grpo_loss.jsonl``: ``result`` is ``_measure``'s (Measurement, footprint) or,
    for a variant that failed, its error message."""
    figures = {"median_s": None, "times_s": None, "cpu_median_s": None, "footprint_bytes": None,
               "peak_growth_bytes": None, "peak_source": None}
    if isinstance(result, str):
        figures["error"] = result
    else:
        m, footprint = result
        figures.update(median_s=m.median_s, times_s=list(m.times_s), cpu_median_s=m.cpu_median_s,
                       footprint_bytes=footprint, peak_growth_bytes=m.peak_rss_growth_bytes, peak_source=m.peak_source)
    return {"run": run, "variant": name, "micro_batches": VARIANTS[name][1].get("micro_batches", 1), "quick": args.quick,
            "model": "SmolLM2-135M-Instruct", "dtype": "float32", "chats": 16, "group": 4, **size,
            "kl_coeff": KL_COEFF, "entropy_coeff": ENTROPY_COEFF, "threads": torch.get_num_threads(),
            "repeats": args.repeats, "warmup": args.warmup, "time_target": TIME_TARGET, "memory_target": MEMORY_TARGET,
            "command": command, **figures, **_results.versions("torch", "torchrl"), **_results.stamp()}


def measure_all(size: dict, args, run: str, command: str) -> list[dict]:
    """Every variant measured in its own process, a record each (torchrl's with an error where it
    does not import here)."""
    records = []
    for name in VARIANTS:
        if name == "torchrl" and not _torchrl_available():
            result = "torchrl does not import in this interpreter: run with .venv-bench/bin/python"
        else:
            try:
                result = _measure(name, size, args)
            except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
                result = child_error(exc)
        records.append(record(run, name, result, size, args, command))
    return records


HEADERS = ["variant", "median wall (s)", "wall times (s)", "median CPU (s)", "step footprint (MiB)",
           "peak growth after warm-up (MiB)", "wall / torchrl", "CPU / torchrl", "footprint / torchrl",
           "time target", "memory target"]


def rows(records: list[dict]) -> list[list[str]]:
    """The table's cells from the records of one run; ratios against that run's torchrl row."""
    base = next((r for r in records if r["variant"] == "torchrl" and not r.get("error")), None)
    out = []
    for r in records:
        if r.get("error"):
            out.append([r["variant"], f"failed: {r['error']}", *[""] * (len(HEADERS) - 2)])
            continue
        row = [r["variant"], f"{r['median_s']:.1f}", " ".join(f"{t:.1f}" for t in r["times_s"]),
               f"{r['cpu_median_s']:.1f}", mib(r["footprint_bytes"]), mib(r["peak_growth_bytes"])]
        if base is None:
            out.append(row + [""] * 5)
            continue
        t_ratio, f_ratio = r["median_s"] / base["median_s"], r["footprint_bytes"] / max(base["footprint_bytes"], 1)
        targets = ["", ""]
        if r["variant"] != "torchrl":
            targets = [verdict(t_ratio, r["time_target"]), verdict(f_ratio, r["memory_target"])]
        out.append(row + [f"{t_ratio:.2f}x", f"{r['cpu_median_s'] / base['cpu_median_s']:.2f}x", f"{f_ratio:.2f}x",
                          *targets])
    return out


def table(records: list[dict]) -> str:
    """docs/performance.md's ``grpo-loss`` table: the newest full (not ``--quick``) run's rows."""
    run = sorted(_results.newest_run(records), key=lambda r: list(VARIANTS).index(r["variant"]))
    if not run:
        return ("No full run of `benchmarks/grpo.py` is recorded yet: `.venv-bench/bin/python benchmarks/grpo.py` "
                "records one in `benchmarks/results/grpo_loss.jsonl`.")
    first = run[0]
    return (markdown_table(HEADERS, rows(run)) + f"\n\n{describe(first)}, group size {first['group']}, KL coeff "
            f"{first['kl_coeff']}, entropy coeff {first['entropy_coeff']}, median of {first['repeats']} after "
            f"{first['warmup']} warm-up; run {first['run']} on {first['machine']}, {first['date']}, commit {first['commit']}, "
            f"{first['threads']} thread(s), torch {first['torch']}, torchrl {first['torchrl']}: `{first['command']}`.")


def describe(size: dict) -> str:
    """The batch in words, from the ``min_words``/``max_words`` of ``size`` (a size or a record)."""
    chats, _, _ = make_chats(size["min_words"], size["max_words"])
    words = [len(c[-1]["content"].split()) for c in chats]
    return f"16 chats, answers of {min(words)}-{max(words)} words (mean {sum(words) / len(words):.0f})"


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short answers, one timed run, no warm-up")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per variant")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs per variant")
    parser.add_argument("--results", type=Path, default=None,
                        help="folder of grpo_loss.jsonl (default: benchmarks/results; a --quick run records only here)")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    print(
        f"GRPOLoss forward+backward, SmolLM2-135M-Instruct float32, {describe(size)}, group size 4, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats} after "
        f"{args.warmup} warm-up; KL coeff {KL_COEFF}, entropy coeff {ENTROPY_COEFF}\n"
    )
    records = measure_all(size, args, _results.run_id(), " ".join(["python", "benchmarks/grpo.py", *argv]))
    print(markdown_table(HEADERS, rows(records)))
    root = _results.destination(args.results, args.quick)
    if root is not None:
        for r in records:
            _results.write("grpo_loss", r, key=("run", "variant"), root=root)
        print(f"\n{len(records)} records in {Path(root) / 'grpo_loss.jsonl'}")
    return records


if __name__ == "__main__":
    main()
