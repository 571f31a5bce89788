"""Forgetting: what training on one task costs the model elsewhere, on prompts it never rewards.

Two measures of a trained policy against its reference, on general chat prompts that hold no
arithmetic (``data/chat_prompts.txt``, written for tether): the exact KL per answer of answers
sampled from the policy (``sampled_kl``, the held-out KL's machinery, on these prompts), and a
capability the base model has that the task does not reward: following an instruction a rule
checks (``RULES``: answering as a bulleted list, opening with Yes or No), scored on greedy
answers. The frontier benchmark records both per run (docs/frontier.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from tether.train.metrics import answered, answering, sampled_kl
from tether.train.rewards import samples_from_batch
from tether.train.tasks import Problem

CHAT_PROMPTS = Path(__file__).resolve().parent / "data" / "chat_prompts.txt"
_WORD = re.compile(r"[A-Za-z']+")


def chat_prompts(n: int | None = None) -> list[str]:
    """The first ``n`` (all when None) general chat prompts of ``data/chat_prompts.txt``."""
    prompts = [line.strip() for line in CHAT_PROMPTS.read_text().splitlines() if line.strip()]
    if n is not None and not 1 <= n <= len(prompts):
        raise ValueError(f"n: expected 1..{len(prompts)} chat prompts (the file holds {len(prompts)}), got {n}; "
                         "ask for fewer or leave n out for all of them.")
    return prompts if n is None else prompts[:n]


def chat_problems(prompts: list[str]) -> list[Problem]:
    """Each prompt as a one-turn chat ``Problem`` with no answer (nothing here is scored by a task)."""
    return [Problem(chat=[{"role": "user", "content": p}], answer="", key=f"chat-{i}") for i, p in enumerate(prompts)]


# ------------------------------------------------------------------------------ the capability
@dataclass(frozen=True)
class Rule:
    """An instruction put before a prompt and the check its answer must pass."""

    instruction: str
    check: Callable[[str], bool]


def _words(text: str) -> list[str]:
    return _WORD.findall(text)


_BULLET = re.compile(r"\s*([-*\u2022]|\d+[.)])\s")


def _bullets(answer: str) -> bool:
    """At least two lines that open with a bullet (``-``, ``*``, ``\u2022``) or a number (``1.``, ``2)``)."""
    return sum(bool(_BULLET.match(line)) for line in answer.splitlines()) >= 2


def _yes_or_no(answer: str) -> bool:
    words = _words(answer)
    return bool(words) and words[0].lower() in ("yes", "no")


# Chosen by the untrained embedded model's rates (docs/frontier.md): it follows these often, not
# always; one word only, capital letters and an opening "Sure" it follows almost never.
RULES: dict[str, Rule] = {
    "bullets": Rule("Answer as a list of three bullet points.", _bullets),
    "yes-or-no": Rule("Start your answer with Yes or No.", _yes_or_no),
}


def instruction_problems(prompts: list[str], rules: list[str]) -> list[tuple[str, Problem]]:
    """``(rule name, problem)`` for prompt i under rule ``rules[i % len(rules)]``: the instruction, a
    space, then the prompt, as one user turn."""
    unknown = [r for r in rules if r not in RULES]
    if unknown or not rules:
        raise ValueError(f"rules: expected a non-empty list of names from {sorted(RULES)}, got {rules}; "
                         "pick among those names.")
    chosen = [rules[i % len(rules)] for i in range(len(prompts))]
    return [(name, Problem(chat=[{"role": "user", "content": f"{RULES[name].instruction} {p}"}], answer="",
                           key=f"rule-{name}-{i}")) for i, (name, p) in enumerate(zip(chosen, prompts))]


@torch.no_grad()
def capability(policy: nn.Module, tokenizer: Any, items: list[tuple[str, Problem]], *, max_new_tokens: int,
               batch_rows: int = 64) -> list[bool]:
    """Whether each greedy answer to ``items`` (``instruction_problems``) passes its rule, in order."""
    wrapper = answering(policy, tokenizer, prompt_format="chat", max_new_tokens=max_new_tokens)
    problems = [p for _, p in items]
    answers = [a for chunk, td in answered(wrapper, problems, "chat", batch_rows)
               for a in samples_from_batch(td, chunk).completions]
    return [RULES[name].check(answer) for (name, _), answer in zip(items, answers)]


# ------------------------------------------------------------------------------ both, for one run
@dataclass(frozen=True)
class Forgetting:
    """A run's forgetting: ``kl_sampled_per_seq`` (nats per sampled answer to the chat prompts),
    ``capability_rate`` (share of rule-checked instructions followed) and each rule's share."""

    kl_sampled_per_seq: float
    capability_rate: float
    capability_per_rule: dict[str, float]
    prompts: int


def measure(policy: nn.Module, reference: nn.Module, tokenizer: Any, task: Any, *, prompts: int | None = None,
            rules: list[str] | None = None, max_new_tokens: int = 48, temperature: float = 1.0,
            seed: int = 0) -> Forgetting:
    """``Forgetting`` of ``policy`` against ``reference`` on the first ``prompts`` chat prompts; the
    KL's answers are sampled at ``temperature`` from a generator seeded ``seed`` (``sampled_kl``;
    ``task`` only tells it the prompts are single-turn: pass the run's task)."""
    texts = chat_prompts(prompts)
    kl = sampled_kl(policy, reference, tokenizer, task, chat_problems(texts), max_new_tokens=max_new_tokens,
                    temperature=temperature, prompt_format="chat", seed=seed)
    items = instruction_problems(texts, list(RULES) if rules is None else rules)
    passed = capability(policy, tokenizer, items, max_new_tokens=max_new_tokens)
    per_rule = {name: sum(ok for (n, _), ok in zip(items, passed) if n == name) / sum(n == name for n, _ in items)
                for name in dict.fromkeys(n for n, _ in items)}
    return Forgetting(kl, sum(passed) / len(passed), per_rule, len(texts))
