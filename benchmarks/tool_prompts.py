"""Prompt designs for ``--task arithmetic-tools`` on the embedded model: accuracy and tool use.

For each design, the same ``n`` products ``a * b`` (``a`` in 100-999, ``b`` in 10-99) run as
multi-turn episodes (``MultiTurnRollout``, calculator, 3 assistant messages of at most 48
tokens): once greedy, as the held-out evaluation of ``tether train`` scores them, and once
sampled at each temperature given, as the training rollouts draw them. Prints one table row
per design and decoding: accuracy, tool-call rate, tool-error rate, seconds.

    PYTHONPATH=src python benchmarks/tool_prompts.py --n 16 --temperatures 1.0 0.7
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from tether.llm import chat_batch
from tether.models import TransformersWrapper, load_default_model
from tether.rollout import MultiTurnRollout, episode_metrics
from tether.train.tasks import EXAMPLE, PHRASINGS, SYSTEM_PROMPT, last_integer

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
# A worked episode of another shape (a sum) than the products asked.
SUM_EXAMPLE = [{"role": "user", "content": "What is 4821 + 977?"}, {"role": "assistant", "content": CALL % "4821 + 977"},
               {"role": "tool", "content": "5798"}, {"role": "assistant", "content": "5798"}]
DESIGNS = {  # name -> (worked example, phrasings of the question)
    "example, one phrasing": (EXAMPLE, PHRASINGS[:1]),
    "no example, one phrasing": ([], PHRASINGS[:1]),
    "sum example, one phrasing": (SUM_EXAMPLE, PHRASINGS[:1]),
    "example, five phrasings (shipped)": (EXAMPLE, PHRASINGS),
}


def chats(example, phrasings, n: int, seed: int):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        question = rng.choice(phrasings).format(a=a, b=b)
        out.append(([{"role": "system", "content": SYSTEM_PROMPT}, *example, {"role": "user", "content": question}], a * b))
    return out


def measure(model, tok, problems, temperature: float | None, seed: int) -> dict[str, float]:
    kwargs = {"max_new_tokens": 48, "do_sample": temperature is not None,
              "generator": torch.Generator().manual_seed(seed)}
    wrapper = TransformersWrapper(model, tok, temperature=temperature or 1.0, generate_kwargs=kwargs)
    start = time.perf_counter()
    td = MultiTurnRollout(wrapper, ["calculator"], max_turns=3)(chat_batch([c for c, _ in problems], key=("history", "prompt")))
    right = [(found := last_integer(text)) is not None and found[0] == answer
             for text, (_, answer) in zip(td["text", "response"], problems)]
    return {"accuracy": sum(right) / len(right), **episode_metrics(td["episode"]), "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--temperatures", type=float, nargs="*", default=[1.0, 0.7])
    parser.add_argument("--designs", nargs="*", default=list(DESIGNS), choices=list(DESIGNS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, tok = load_default_model()
    print("| design | decoding | accuracy | tool-call rate | tool-error rate | s |\n|---|---|---|---|---|---|")
    for name in args.designs:
        problems = chats(*DESIGNS[name], args.n, args.seed)
        for temperature in [None, *args.temperatures]:
            m = measure(model, tok, problems, temperature, args.seed)
            how = "greedy" if temperature is None else f"sampled, T={temperature}"
            print(f"| {name} | {how} | {m['accuracy']:.2f} | {m['tool_call_rate']:.2f} | "
                  f"{m['tool_error_rate']:.2f} | {m['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
