"""What a three-turn tool episode costs to sample: KV cache kept across turns against prefilling
every turn again, and against one single-turn sample of the same tokens.

The embedded model, ``--task arithmetic-tools``'s prompts (system prompt, worked example,
question), ``--episodes`` episodes of up to three assistant messages: every message that ends with
its end-of-turn token is read as a calculator call (a parser that always finds one), so a tool
turn follows it; the third message, or one cut at ``--max-new-tokens``, ends the episode. The
single-turn baseline samples, after the same prompts, as many tokens per row as the episode
sampled in all its messages (forced lengths), in one call. Each variant runs ``--repeats`` times
from the same seed; the table gives medians and ratios to the baseline. A run appends one record
to ``benchmarks/results/multi_turn_cache.jsonl`` (``--results DIR`` elsewhere); ``table`` builds
the README's and docs/tools.md's table from the newest.

    python benchmarks/multi_turn_cache.py [--episodes 16] [--max-new-tokens 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

from tether.models import TransformersWrapper
from tether.models.batch_io import write_objects
from tether.models.chat import render_chat_ids
from tether.models.default_model import load_default_model
from tether.models.sampling import sample_responses
from tether.rollout import MultiTurnRollout, ParsedCall
from tether.train.tasks import load_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="per assistant message")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--results", type=Path, default=None, help="folder of multi_turn_cache.jsonl "
                        "(default: benchmarks/results)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_default_model()
    task = load_task("arithmetic-tools")
    chats = [task.train_problem(0, i, set()).chat for i in range(args.episodes)]
    always = lambda text: [ParsedCall("calculator", {"expression": "12*34"})]  # noqa: E731

    def episodes(kv_cache: bool):
        wrapper = TransformersWrapper(model, tok, temperature=0.7, generate_kwargs={
            "max_new_tokens": args.max_new_tokens, "generator": torch.Generator().manual_seed(0)})
        from tensordict import TensorDict

        td = TensorDict({}, batch_size=[len(chats)])
        write_objects(td, ("history", "prompt"), chats)
        return MultiTurnRollout(wrapper, max_turns=3, tool_format=always, kv_cache=kv_cache)(td)

    td = episodes(True)
    sampled = td["masks", "all_assistant_mask"].sum(-1)
    prompts = [render_chat_ids(tok, chat, add_generation_prompt=True) for chat in chats]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tok.pad_token_id)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, row in enumerate(prompts):
        ids[i, width - len(row):], mask[i, width - len(row):] = torch.tensor(row), True

    def single_turn():
        return sample_responses(model, ids, mask, max_new_tokens=int(sampled.max()), eos_ids={-1},
                                pad_id=tok.pad_token_id, temperature=0.7, row_limits=sampled.clone(),
                                generator=torch.Generator().manual_seed(0))

    variants = {"single turn, same tokens": single_turn, "three turns, cache kept": lambda: episodes(True),
                "three turns, prefilled each turn": lambda: episodes(False)}
    times = {name: [] for name in variants}
    with torch.no_grad():
        for _ in range(args.repeats):
            for name, fn in variants.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    turns = td["episode", "turns"].tolist()
    record = {"run": _results.run_id(), "episodes": len(chats), "max_new_tokens": args.max_new_tokens,
              "threads": args.threads, "repeats": args.repeats, "turns": [min(turns), max(turns)],
              "sampled_tokens": int(sampled.sum()), "all_tokens": int(td["masks", "all_attention_mask"].sum()),
              "seconds": {VARIANTS[name]: values for name, values in times.items()},
              **_results.versions("torch"), **_results.stamp()}
    _results.write("multi_turn_cache", record, key=("run",), root=args.results)
    print(table([record]))


# the record's name of each variant, and the table's
VARIANTS = {"single turn, same tokens": "single_turn", "three turns, cache kept": "cache_kept",
            "three turns, prefilled each turn": "prefilled"}
TITLES = {"single_turn": "one turn, the same sampled tokens", "cache_kept": "three turns, cache kept (the default)",
          "prefilled": "three turns, the conversation prefilled every turn"}


def table(records: list[dict[str, Any]]) -> str:
    """The newest run: median seconds of each variant and its ratio to one turn of the same tokens."""
    if not records:
        return ("No run is recorded yet: `python benchmarks/multi_turn_cache.py --threads 1` records one in "
                "`benchmarks/results/multi_turn_cache.jsonl`.")
    r = max(records, key=lambda r: r["run"])
    medians = {k: statistics.median(v) for k, v in r["seconds"].items()}
    lines = ["| sampling | seconds | × one turn of the same tokens |", "|---|---|---|"]
    for key, title in TITLES.items():
        ratio = f"{medians[key] / medians['single_turn']:.2f}"
        lines.append(f"| {title} | {medians[key]:.1f} | {'**' + ratio + '**' if key == 'cache_kept' else ratio} |")
    return "\n".join(lines) + (
        f"\n\n{r['episodes']} episodes of {r['turns'][0]}-{r['turns'][1]} messages, {r['sampled_tokens']} sampled "
        f"tokens, up to {r['max_new_tokens']} a message; {r['threads']} thread(s), median of {r['repeats']}; "
        f"{r['machine']}, {r['date']}, commit {r['commit']}.")


if __name__ == "__main__":
    main()
