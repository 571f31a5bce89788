"""Plain-torch references and shared data for the tether.llm tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tensordict import TensorDictBase

MULTI_TURN = [
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "bc"},
        {"role": "user", "content": "d"},
        {"role": "assistant", "content": "efg"},
    ],
    [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "done."},
    ],
]
PROMPTS = [
    [{"role": "user", "content": "What is 2+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]


def naive_logprobs(model, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Aligned log-probs of one unpadded row ``[T]``: full logits, log_softmax, gather."""
    logits = model(input_ids=ids[None]).logits[0, :-1].double() / temperature
    lp = F.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)
    return torch.cat([lp.new_zeros(1), lp])


def rows(td: TensorDictBase, key) -> list[torch.Tensor]:
    """The valid entries of each row of a padded (with attention mask) or nested entry."""
    value = td.get(key)
    if value.is_nested:
        return list(value.unbind())
    mask = td.get(("masks", "all_attention_mask"))
    return [v[m] for v, m in zip(value, mask)]


def token_rows(td: TensorDictBase) -> list[torch.Tensor]:
    return rows(td, ("tokens", "full"))
