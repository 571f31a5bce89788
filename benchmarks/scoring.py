"""Every public scoring entry point of tether against TorchRL, on real chats and the embedded model.

Times each tether entry point (policy + reference, reference only, the Ray ``ReferenceService``'s
actor body in process, and the KL job reusing the sampler's log-probs) against the TorchRL class
doing the same job (``RetrieveKL``, ``RetrieveLogProb``) on 16 seeded chats of 95-240 tokens
scored by SmolLM2-135M-Instruct (float32, CPU): wall and process-CPU time and peak resident-set
growth, each measurement a fresh process, the ratios paired within a round, the median over
``--rounds``. The rows, what each side runs and how a round pairs them: docs/performance.md,
"How it is measured". ``--ray-python`` names an interpreter that has Ray for the service row
(default: this one when it imports ``ray``, else the row is skipped). A full run records one row
of the table a line in ``benchmarks/results/scoring.jsonl`` (``--results DIR`` elsewhere, a
``--quick`` run records only there); ``scoring_tables.py`` builds docs/performance.md's table.

    .venv-bench/bin/python benchmarks/scoring.py            # both libraries, 2 threads, 2 rounds
    .venv-bench/bin/python benchmarks/scoring.py --quick    # 4 chats, one round, one timed call
    .venv-bench/bin/python benchmarks/scoring.py --ray-python .venv/bin/python
    .venv/bin/python benchmarks/scoring.py --no-torchrl     # tether only (no torchrl there)
    .venv-bench/bin/python benchmarks/scoring.py --compile --warmup 2  # tether's decoders compiled
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _results  # noqa: E402
import scoring_tables  # noqa: E402
from _common import child_error, measure_in_subprocess  # noqa: E402

FULL_CHATS, QUICK_CHATS = 16, 4
MIN_TOKENS, MAX_TOKENS = 95, 240
SEED = 0

@dataclass(frozen=True)
class EntryPoint:
    """One tether entry point timed against one TorchRL job, with the issue's targets."""

    label: str
    inputs: str  # "chats" or "tokens"
    baseline: str  # TorchRL job: "kl" (policy + reference) or "ref" (reference only)
    time_target: float
    memory_target: float
    setup: str | None = None  # the entry point whose set-up this row times, when not its own key


KL_TARGETS, REF_TARGETS = (0.55, 0.45), (0.55, 0.40)
ENTRY_POINTS = {
    "kl-chats": EntryPoint("RetrieveKL", "chats", "kl", *KL_TARGETS),
    "kl-tokens": EntryPoint("RetrieveKL", "tokens", "kl", *KL_TARGETS),
    "ref-chats": EntryPoint("RetrieveLogProb", "chats", "ref", *REF_TARGETS),
    "ref-tokens": EntryPoint("RetrieveLogProb", "tokens", "ref", *REF_TARGETS),
    "reuse": EntryPoint("RetrieveKL(gen_model=None)", "tokens", "ref", *REF_TARGETS),
    # The KL job done by reusing the sampler's log-probs, against TorchRL rescoring the policy too.
    "reuse-kl": EntryPoint("RetrieveKL(gen_model=None), sampling log-probs reused", "tokens", "kl", *KL_TARGETS,
                           setup="reuse"),
    "kl-reward": EntryPoint("KLRewardTransform", "tokens", "ref", *REF_TARGETS),
    "service": EntryPoint("ReferenceService (actor body)", "tokens", "ref", *REF_TARGETS),
}
WORDS = (
    "the a model answer question number river light stone garden quickly slowly seven "
    "twelve because window paper music green blue train city morning evening explain "
    "simple careful reason value shape count table letter history planet ocean forest "
    "carry build open close write read think learn small large bright quiet warm cold"
).split()


# ------------------------------------------------------------------ workload
def _sentence(rng: random.Random, low: int, high: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(low, high))]
    return " ".join(words).capitalize() + rng.choice([".", "?", "!"])


def _length(tokenizer, chat) -> int:
    return len(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False))


def make_chats(tokenizer, n_chats: int, seed: int = SEED) -> list[list[dict[str, str]]]:
    """``n_chats`` seeded chats whose renderings are MIN_TOKENS..MAX_TOKENS tokens long."""
    rng = random.Random(seed)
    chats = []
    for _ in range(n_chats):
        target = rng.randint(MIN_TOKENS, MAX_TOKENS)
        chat = [{"role": "system", "content": _sentence(rng, 3, 8)}]
        for _turn in range(rng.randint(1, 3)):
            chat.append({"role": "user", "content": _sentence(rng, 4, 14)})
            chat.append({"role": "assistant", "content": _sentence(rng, 4, 20)})
            if _length(tokenizer, chat) >= target - 20:
                break
        while _length(tokenizer, chat) < target:
            chat[-1]["content"] += " " + rng.choice(WORDS)
        while _length(tokenizer, chat) > MAX_TOKENS:
            chat[-1]["content"] = chat[-1]["content"].rsplit(" ", 1)[0]
        chats.append(chat)
    return chats


def _models():
    from tether.models import frozen_copy, load_default_model

    model, tokenizer = load_default_model()
    return model, frozen_copy(model), tokenizer


# ------------------------------------------------------------------ tether variants
def _sampled_batch(policy, chats):
    """The chats as a sampler leaves them: tokens, masks and the policy's log-probs."""
    from tether.llm import RetrieveLogProb, chat_batch

    keep = [("history", "full"), ("tokens", "full"), ("masks", "all_attention_mask"),
            ("masks", "all_assistant_mask"), ("log_probs", "full")]
    return RetrieveLogProb(policy)(chat_batch(chats)).select(*keep)


def _service_call(reference, batch):
    """One request through the ``ReferenceService`` actor body (needs Ray importable)."""
    from tether.ray.reference_client import ScoreRequest
    from tether.ray.reference_server import BatchLimits, ReferenceServer

    server = ReferenceServer(reference, None, BatchLimits(), None, 0)
    tokens, mask = batch["tokens", "full"], batch["masks", "all_attention_mask"]
    count = iter(range(10**9))
    return lambda: server._forward([ScoreRequest(f"r{next(count)}", tokens, mask)])


def setup_tether(variant: str, n_chats: int, threads: int, token_budget: int | None = None, compile: bool = False):
    """Build models and workload; return the callable timed for entry point ``variant``."""
    import torch

    from tether.llm import KLRewardTransform, RetrieveKL, RetrieveLogProb, chat_batch
    from tether.models import TransformersWrapper

    torch.set_num_threads(threads)
    variant = ENTRY_POINTS[variant].setup or variant
    policy_model, reference_model, tok = _models()
    if compile:  # the user's one line: torch.compile the decoders the scoring engine calls (once per process)
        for model in (policy_model, reference_model):
            model.get_decoder().compile(dynamic=True)
    chats = make_chats(tok, n_chats)
    tuned = {} if token_budget is None else {"token_budget": token_budget}
    policy = TransformersWrapper(policy_model, tok, generate=False, **tuned)
    reference = TransformersWrapper(reference_model, tok, generate=False, log_probs_key="ref_log_probs", **tuned)
    entry = ENTRY_POINTS[variant]
    sampled = _sampled_batch(policy, chats) if entry.inputs == "tokens" else None
    if variant == "service":
        return _service_call(reference, sampled)
    if variant == "kl-reward":
        module = KLRewardTransform(reference, log_prob_key=("log_probs", "full"))
        sampled.set("reward", torch.ones(n_chats, 1))
    elif variant == "reuse":
        module = RetrieveKL(None, reference, add_to_reward=False)
    elif variant.startswith("kl"):
        module = RetrieveKL(policy, reference, add_to_reward=False)
    else:
        module = RetrieveLogProb(reference)
    if sampled is None:
        return lambda: module(chat_batch(chats))
    if variant in ("kl-tokens", "ref-tokens"):
        sampled = sampled.exclude(("log_probs", "full"))
    return lambda: module(sampled.copy())


# ------------------------------------------------------------------ TorchRL variants
def setup_torchrl(variant: str, n_chats: int, threads: int):
    """TorchRL's wrapper and transforms on the same models and chats, under no_grad."""
    import torch
    from tensordict import TensorDict, set_list_to_stack
    from torchrl.data.llm import History
    from torchrl.envs.llm.transforms.kl import RetrieveKL, RetrieveLogProb
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.modules.llm.policies import ChatHistory

    torch.set_num_threads(threads)
    set_list_to_stack(True).set()
    policy_model, reference_model, tok = _models()
    chats = make_chats(tok, n_chats)
    common = dict(tokenizer=tok, input_mode="history", generate=False, return_log_probs=True, pad_output=True)
    policy = TransformersWrapper(policy_model, log_probs_key="log_probs", **common)
    reference = TransformersWrapper(reference_model, log_probs_key="ref_log_probs", **common)
    if variant == "kl":
        module = RetrieveKL(gen_model=policy, ref_model=reference, assistant_only=True, tokenizer=tok,
                            add_to_reward=False)
    else:
        module = RetrieveLogProb(reference, assistant_only=True, tokenizer=tok)

    def run():
        history = ChatHistory(full=History.from_chats(chats))
        td = TensorDict(history=history, batch_size=(len(chats),))
        with torch.no_grad():
            module(td)

    return run


# ------------------------------------------------------------------ driver
def _torchrl_available() -> bool:
    if importlib.util.find_spec("torchrl") is None:
        return False
    try:
        import torchrl.envs.llm.transforms.kl  # noqa: F401
        import torchrl.modules.llm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "skip TorchRL"
        return False
    return True


@dataclass
class Rounds:
    """Every measurement of one run: per round, TorchRL's jobs and tether's entry points, each a
    ``Measurement`` or, when it failed, its error message."""

    theirs: list[dict] = field(default_factory=list)
    ours: list[dict] = field(default_factory=list)


RATIOS = {"wall": "median_s", "cpu": "cpu_median_s", "memory": "peak_rss_growth_bytes"}


def _summary(measurements: list) -> dict:
    """A row's figures: each round's measurement and the medians over the rounds that the table
    shows (an ``error`` and no medians when a round failed)."""
    out = {"per_round": [{"error": m} if isinstance(m, str) else asdict(m) for m in measurements]}
    failed = next((m for m in measurements if isinstance(m, str)), None)
    if failed is not None:
        return {**out, "error": failed, "wall_s": None, "cpu_s": None, "peak_rss_growth_bytes": None,
                "peak_source": None}
    return {**out, "wall_s": statistics.median(m.median_s for m in measurements),
            "cpu_s": statistics.median(m.cpu_median_s for m in measurements),
            "peak_rss_growth_bytes": statistics.median(m.peak_rss_growth_bytes for m in measurements),
            "peak_source": ", ".join(sorted({m.peak_source for m in measurements}))}


def _ratios(ours: list, theirs: list) -> dict:
    """Each round's tether / TorchRL ratios, against that round's TorchRL figure, and their medians
    over the rounds; None where TorchRL did not run or either side failed."""
    if not theirs or any(isinstance(m, str) for m in ours + theirs):
        return {"ratio_rounds": None, **{f"{k}_ratio": None for k in RATIOS}}
    per = [{k: getattr(o, a) / max(getattr(t, a), 1e-9) for k, a in RATIOS.items()} for o, t in zip(ours, theirs)]
    return {"ratio_rounds": per, **{f"{k}_ratio": statistics.median(p[k] for p in per) for k in RATIOS}}


def records(rounds: Rounds, variants: list[str], common: dict) -> list[dict]:
    """The rows of ``scoring.jsonl``: one a tether entry point, then one a TorchRL job; ``common``
    holds the run, the workload, the versions and the stamp."""
    out = []
    for variant in variants:
        entry = ENTRY_POINTS[variant]
        ours, theirs = [r[variant] for r in rounds.ours], [r[entry.baseline] for r in rounds.theirs]
        out.append({**common, "tool": "tether", "entry": variant, "label": entry.label, "input": entry.inputs,
                    "against": entry.baseline, "time_target": entry.time_target,
                    "memory_target": entry.memory_target, **_summary(ours), **_ratios(ours, theirs)})
    for job in sorted({t for r in rounds.theirs for t in r}):
        out.append({**common, "tool": "torchrl", "entry": job, "label": f"TorchRL {job}", "input": "chats",
                    "against": None, "time_target": None, "memory_target": None,
                    **_summary([r[job] for r in rounds.theirs])})
    return out


def measure_rounds(n_chats: int, args, torchrl: str | None, variants: list[str]) -> Rounds:
    """``args.rounds`` rounds of TorchRL's job then tether's entry points doing it. ``torchrl``:
    "yes", None (not asked for) or why it cannot run here (recorded as its rows' error)."""
    def measure(setup: str, variant: str, python: str | None = None):
        kwargs = {"variant": variant, "n_chats": n_chats, "threads": args.threads}
        if setup == "setup_tether" and args.token_budget is not None:
            kwargs["token_budget"] = args.token_budget
        if setup == "setup_tether" and args.compile:
            kwargs["compile"] = True
        try:
            return measure_in_subprocess(__file__, setup, kwargs, repeats=args.repeats, warmup=args.warmup,
                                         python=python)
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
            return child_error(exc)

    rounds = Rounds()
    for _ in range(args.rounds):
        theirs, ours = {}, {}
        for job in sorted({ENTRY_POINTS[v].baseline for v in variants}):
            if torchrl is not None:
                theirs[job] = measure("setup_torchrl", job) if torchrl == "yes" else torchrl
            for variant in (v for v in variants if ENTRY_POINTS[v].baseline == job):
                ours[variant] = measure("setup_tether", variant, args.ray_python if variant == "service" else None)
        rounds.ours.append(ours)
        if torchrl is not None:
            rounds.theirs.append(theirs)
    return rounds


def common_fields(n_chats: int, args, run: str, command: str) -> dict:
    """What every row of one run shares: the run, the workload, the settings and the versions."""
    return {"run": run, "quick": args.quick, "chats": n_chats, "min_tokens": MIN_TOKENS, "max_tokens": MAX_TOKENS,
            "seed": SEED, "model": "SmolLM2-135M-Instruct", "dtype": "float32", "threads": args.threads,
            "repeats": args.repeats, "warmup": args.warmup, "rounds": args.rounds, "compile": args.compile,
            "token_budget": args.token_budget, "command": command, **_results.versions("torch", "torchrl"),
            **_results.stamp()}


def _ray_python(requested: str | None) -> str | None:
    if requested is not None:
        return requested
    return sys.executable if importlib.util.find_spec("ray") is not None else None


def main(argv=None) -> list[dict]:
    import torch

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 chats, one round, one timed call")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per process")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per process")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of TorchRL/tether alternation")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument("--token-budget", type=int, default=None, help="TransformersWrapper(token_budget=N) for tether")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile tether's decoders before timing (the compile falls in the warm-up)")
    parser.add_argument("--only", nargs="+", choices=sorted(ENTRY_POINTS), default=None, help="entry points to time")
    parser.add_argument("--ray-python", default=None, help="interpreter with Ray for the service row")
    parser.add_argument("--no-torchrl", action="store_true", help="tether entry points only")
    parser.add_argument("--results", type=Path, default=None,
                        help="folder of scoring.jsonl (default: benchmarks/results; a --quick run records only here)")
    args = parser.parse_args(argv)
    n_chats = QUICK_CHATS if args.quick else FULL_CHATS
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.ray_python = _ray_python(args.ray_python)
    variants = [v for v in (args.only or ENTRY_POINTS) if v != "service" or args.ray_python is not None]
    with_torchrl = not args.no_torchrl and _torchrl_available()
    torchrl = None if args.no_torchrl else "yes" if with_torchrl else (
        "torchrl does not import in this interpreter: run with .venv-bench/bin/python")
    print(
        f"scoring {n_chats} chats ({MIN_TOKENS}-{MAX_TOKENS} tokens, seed {SEED}) with "
        f"SmolLM2-135M-Instruct float32, torch {torch.__version__}, {args.threads} thread(s), "
        f"median of {args.repeats} calls after {args.warmup} warm-up per process, {args.rounds} round(s), "
        f"{'with' if with_torchrl else 'without'} TorchRL"
        + ("" if args.ray_python else "; no Ray here: service row skipped (--ray-python)") + "\n"
    )
    rows = records(measure_rounds(n_chats, args, torchrl, variants), variants,
                   common_fields(n_chats, args, _results.run_id(), " ".join(["python", "benchmarks/scoring.py", *argv])))
    print(scoring_tables.body(rows))
    root = _results.destination(args.results, args.quick)
    if root is not None:
        for row in rows:
            _results.write("scoring", row, key=("run", "tool", "entry"), root=root)
        print(f"\n{len(rows)} records in {Path(root) / 'scoring.jsonl'}")
    return rows


if __name__ == "__main__":
    main()
