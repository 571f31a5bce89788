"""Scoring a batch of chats for the KL leash: tether against TorchRL on the embedded model.

Workload: 16 chats (seeded: random user/assistant text, one to three assistant turns, each
chat 95-240 tokens when rendered, all opening with a system message so that TorchRL's
substituted ChatML template and the shipped one give the same tokens), scored by
SmolLM2-135M-Instruct (float32, CPU). Variants, each in a fresh process (median after a
warm-up, peak resident-set growth over the state after setup):

- ``kl``: policy + reference log-probs and their KL (``RetrieveKL`` with two scoring
  wrappers, the reference a ``frozen_copy``);
- ``ref``: reference log-probs only (``RetrieveLogProb``);
- ``reuse``: tether's ``RetrieveKL(gen_model=None)``: the sampling log-probs are already in
  the batch (computed once in setup, outside the timed region), only the reference runs.

TorchRL runs (when ``torchrl`` imports) under ``torch.no_grad()`` with its own
``TransformersWrapper`` (history input, ``pad_output=True``), ``RetrieveKL`` and
``RetrieveLogProb``; it has no reuse mode, so ``reuse`` is compared with its ``kl`` time.
Both sides skip the reward (``add_to_reward=False``; TorchRL's ``KLComputation`` wants a
per-token reward of the padded width). Each timed call starts from a fresh batch of chats,
so every call renders and tokenises.

Each process uses one torch thread by default (``--threads``): on a CPU shared with other
jobs, two OpenMP threads wait on each other at every barrier and the same call then varies
by 10x; one thread keeps repeat-to-repeat spread to a few percent. ``--token-budget N``
adds rows for tether with ``TransformersWrapper(token_budget=N)`` (rows per scoring pass
sized to N tokens: less padding in mixed-length batches).

    .venv-bench/bin/python benchmarks/scoring.py          # both libraries (~11 min; ~16 with --token-budget)
    .venv-bench/bin/python benchmarks/scoring.py --quick  # 4 chats, one timed run
    .venv/bin/python benchmarks/scoring.py                # tether only (no torchrl there)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import markdown_table, measure_in_subprocess, mib  # noqa: E402

FULL_CHATS, QUICK_CHATS = 16, 4
MIN_TOKENS, MAX_TOKENS = 95, 240
SEED = 0
# (variant, TorchRL baseline variant, time target, memory target or None)
TARGETS = {
    "kl": ("kl", 0.55, 0.45),
    "ref": ("ref", 0.55, 0.40),
    "reuse": ("kl", 0.35, None),
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
def setup_tether(variant: str, n_chats: int, threads: int, token_budget: int | None = None):
    """Build models and workload; return the callable timed for ``variant``."""
    import torch

    from tether.llm import RetrieveKL, RetrieveLogProb, chat_batch
    from tether.models import TransformersWrapper

    torch.set_num_threads(threads)
    policy_model, reference_model, tok = _models()
    chats = make_chats(tok, n_chats)
    tuned = {} if token_budget is None else {"token_budget": token_budget}
    policy = TransformersWrapper(policy_model, tok, generate=False, **tuned)
    reference = TransformersWrapper(reference_model, tok, generate=False, log_probs_key="ref_log_probs", **tuned)
    if variant == "kl":
        module = RetrieveKL(policy, reference, add_to_reward=False)
        return lambda: module(chat_batch(chats))
    if variant == "ref":
        module = RetrieveLogProb(reference)
        return lambda: module(chat_batch(chats))
    # reuse: a batch as a sampler leaves it (tokens, masks, sampling log-probs), built once.
    keep = [("history", "full"), ("tokens", "full"), ("masks", "all_attention_mask"),
            ("masks", "all_assistant_mask"), ("log_probs", "full")]
    sampled = RetrieveLogProb(policy)(chat_batch(chats)).select(*keep)
    module = RetrieveKL(None, reference, add_to_reward=False)
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


def _verdict(ratio: float, target: float) -> str:
    return f"{'met' if ratio <= target else 'missed'} (<= {target}x)"


def _tether_rows(label: str, ours: dict, theirs: dict) -> list[list[str]]:
    rows = []
    for variant, (base_name, time_target, mem_target) in TARGETS.items():
        m = ours[variant]
        row = [variant, label, f"{m.median_s:.3f}", mib(m.peak_rss_growth_bytes)]
        base = theirs.get(base_name)
        if base is None:
            rows.append(row + ["", "", "", ""])
            continue
        t_ratio = m.median_s / base.median_s
        m_ratio = m.peak_rss_growth_bytes / max(base.peak_rss_growth_bytes, 1)
        mem_cells = [f"{m_ratio:.3f}x", _verdict(m_ratio, mem_target)] if mem_target else ["", ""]
        rows.append(row + [f"{t_ratio:.2f}x (vs TorchRL {base_name})", _verdict(t_ratio, time_target), *mem_cells])
    return rows


def run_table(n_chats: int, repeats: int, warmup: int, threads: int, with_torchrl: bool,
              token_budget: int | None) -> str:
    def measure(setup: str, variant: str, **extra):
        kwargs = {"variant": variant, "n_chats": n_chats, "threads": threads, **extra}
        return measure_in_subprocess(__file__, setup, kwargs, repeats=repeats, warmup=warmup)

    theirs = {v: measure("setup_torchrl", v) for v in ("kl", "ref")} if with_torchrl else {}
    ours = {v: measure("setup_tether", v) for v in TARGETS}
    rows = _tether_rows("tether (defaults)", ours, theirs)
    measured = [*theirs.values(), *ours.values()]
    if token_budget is not None:
        tuned = {v: measure("setup_tether", v, token_budget=token_budget) for v in TARGETS}
        rows += _tether_rows(f"tether (token_budget={token_budget})", tuned, theirs)
        measured += tuned.values()
    for variant, m in theirs.items():
        rows.append([variant, "TorchRL", f"{m.median_s:.3f}", mib(m.peak_rss_growth_bytes), "1.00x", "", "1.000x", ""])
    headers = ["variant", "library", "median time (s)", "peak RSS growth (MiB)", "time ratio",
               "time target", "memory ratio", "memory target"]
    sources = sorted({m.peak_source for m in measured})
    return markdown_table(headers, rows) + f"\n\npeak memory read from: {', '.join(map(str, sources))}"


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 chats, one timed run")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--token-budget", type=int, default=None,
                        help="also time tether with TransformersWrapper(token_budget=N)")
    parser.add_argument("--no-torchrl", action="store_true", help="tether variants only")
    args = parser.parse_args(argv)
    n_chats = QUICK_CHATS if args.quick else FULL_CHATS
    repeats = args.repeats or (1 if args.quick else 3)
    with_torchrl = not args.no_torchrl and _torchrl_available()
    print(
        f"scoring {n_chats} chats ({MIN_TOKENS}-{MAX_TOKENS} tokens, seed {SEED}) with "
        f"SmolLM2-135M-Instruct float32, torch {torch.__version__}, {args.threads} "
        f"thread(s), median of {repeats} after {args.warmup} warm-up, "
        f"{'with' if with_torchrl else 'without'} TorchRL\n"
    )
    print(run_table(n_chats, repeats, args.warmup, args.threads, with_torchrl, args.token_budget))


if __name__ == "__main__":
    main()
