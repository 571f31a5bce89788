"""Builders shared by the rollout tests: tiny policy/reference/reward models and prompt batches.

Everything is float64 where values are recomputed, so the independent checks can be tight.
"""

from __future__ import annotations

import math

import torch

from tests.helpers import make_tiny_classifier
import torch.nn.functional as F


from tests.helpers import make_tiny_model
from tether.models import SequenceRewardModel
from tether.rollout import LABEL_IGNORE_INDEX, PromptBatch

EOS = 258


def eos_leaning_policy(tok, *, p_eos: float, seed: int = 0, dtype=torch.float64):
    """Tiny policy whose head is shrunk and biased so eos has probability ~p_eos per step.

    The original head is kept at 10 % so that the other tokens still depend on the context
    (a non-trivial log-ratio to the reference); the eos bias is ``log(p (V-1) / (1-p))``.
    """
    model = make_tiny_model(tok, seed=seed, dtype=dtype)
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(old.weight * 0.1)
        head.bias.zero_()
        head.bias[EOS] = math.log(p_eos * (old.out_features - 1) / (1 - p_eos))
    model.lm_head = head
    return model


def reward_model(seed: int = 7, dtype=torch.float64) -> SequenceRewardModel:
    """A 2-layer random Llama classifier (one label) without a pad id.

    Without ``pad_token_id`` Hugging Face pools a single unpadded row at its last token, which
    gives the tests an independent end score (``classifier(row[None]).logits``).
    """
    model = make_tiny_classifier(seed=seed, dtype=dtype)
    return SequenceRewardModel(model)


def prompt_batch(prompts, completions, *, pad: int, width: int | None = None, with_labels: bool = False):
    """Right-padded ``PromptBatch`` of prompt + reference completion rows.

    With ``with_labels`` the completion is given through ``labels`` (and ``input_ids`` holds
    the prompt only); otherwise it follows the prompt in ``input_ids`` (the seed's layout).
    """
    rows = [list(p) + list(c) for p, c in zip(prompts, completions)]
    width = width or max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    labels = torch.full((len(rows), width), LABEL_IGNORE_INDEX, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        kept = len(p) if with_labels else len(p) + len(c)
        ids[i, :kept] = torch.tensor(rows[i][:kept], dtype=torch.long)
        mask[i, :kept] = True
        labels[i, len(p) : len(p) + len(c)] = torch.tensor(list(c), dtype=torch.long)
    rindex = torch.tensor([len(p) for p in prompts])
    return PromptBatch.from_tensors(ids, mask, rindex, labels if with_labels else None)


def token_log_probs(model, row: torch.Tensor, start: int, temperature: float) -> torch.Tensor:
    """log p(row[t] | row[:t]) for t >= start, from full logits of the unpadded row."""
    with torch.no_grad():
        logits = model(input_ids=row[None]).logits[0].double() / temperature
    return F.log_softmax(logits[start - 1 : -1], dim=-1).gather(-1, row[start:, None]).squeeze(-1)


def end_score(rm: SequenceRewardModel, row: torch.Tensor) -> float:
    """Hugging Face's own pooled score of one unpadded row (its last token)."""
    with torch.no_grad():
        return float(rm.model(input_ids=row[None]).logits[0, 0])


def storage_bytes(td) -> int:
    """Bytes actually allocated by the leaves of ``td`` (shared storages counted once)."""
    seen: dict[int, int] = {}
    for value in td.values(include_nested=True, leaves_only=True):
        storage = value.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
