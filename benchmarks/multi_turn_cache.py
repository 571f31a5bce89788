"""What a three-turn tool episode costs to sample: KV cache kept across turns against prefilling
every turn again, and against one single-turn sample of the same tokens.

The embedded model, ``--task arithmetic-tools``'s prompts (system prompt, worked example,
question), ``--episodes`` episodes of up to three assistant messages: every message that ends with
its end-of-turn token is read as a calculator call (a parser that always finds one), so a tool
turn follows it; the third message, or one cut at ``--max-new-tokens``, ends the episode. The
single-turn baseline samples, after the same prompts, as many tokens per row as the episode
sampled in all its messages (forced lengths), in one call. Each variant runs ``--repeats`` times
from the same seed; the table gives medians and ratios to the baseline.

    python benchmarks/multi_turn_cache.py [--episodes 16] [--max-new-tokens 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

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
    print(f"{len(chats)} episodes, turns {min(turns)}-{max(turns)}, {int(sampled.sum())} sampled tokens, "
          f"{int(td['masks', 'all_attention_mask'].sum())} tokens in all; {args.threads} threads, "
          f"median of {args.repeats}")
    base = statistics.median(times["single turn, same tokens"])
    print("| variant | seconds | x single turn |\n|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | {statistics.median(values) / base:.2f} |")


if __name__ == "__main__":
    main()
