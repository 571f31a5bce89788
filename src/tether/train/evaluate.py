"""Held-out evaluation: greedy accuracy and the KL to the reference along the answers.

Accuracy uses greedy decoding. The KL reported is the exact full-vocabulary
KL(pi || pi_ref) at every answer token, averaged per token and summed per answer: greedy
answers are not samples of pi, so a log-ratio estimate along them would not estimate a KL,
while the exact per-position KL is well defined on any sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from tether.models import TransformersWrapper
from tether.models.scoring import exact_kl_tokens
from tether.train.tasks import Problem, Task

_EVAL_BATCH = 64


@dataclass
class EvalResult:
    accuracy: float
    kl_per_token: float
    kl_per_seq: float
    response_length: float
    n: int

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@torch.no_grad()
def evaluate(
    policy: nn.Module,
    reference: nn.Module | None,
    tokenizer,
    task: Task,
    problems: list[Problem],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    with_kl: bool = True,
) -> EvalResult:
    """Greedy accuracy on ``problems`` and (optionally) the exact KL along the answers."""
    from tether.llm import chat_batch

    wrapper = TransformersWrapper(
        policy, tokenizer, generate=True, temperature=temperature,
        generate_kwargs={"max_new_tokens": max_new_tokens, "do_sample": False},
    )
    correct = 0
    kl_sum = torch.zeros((), dtype=torch.float64)
    tokens_total = 0
    for begin in range(0, len(problems), _EVAL_BATCH):
        chunk = problems[begin : begin + _EVAL_BATCH]
        td = wrapper(chat_batch([p.chat for p in chunk], key=("history", "prompt")))
        answers = td.get(("text", "response")).tolist()
        correct += sum(task.correct_value(task.is_correct(a, p)) for a, p in zip(answers, chunk))
        response = td["masks", "all_assistant_mask"]
        tokens_total += int(response.sum())
        if with_kl and reference is not None:
            kl = exact_kl_tokens(policy, reference, td["tokens", "full"], td["masks", "all_attention_mask"],
                                 temperature=temperature, where=response.bool())
            kl_sum += (kl.double() * response).sum()
    n = len(problems)
    return EvalResult(
        accuracy=correct / max(n, 1),
        kl_per_token=float(kl_sum) / max(tokens_total, 1),
        kl_per_seq=float(kl_sum) / max(n, 1),
        response_length=tokens_total / max(n, 1),
        n=n,
    )
