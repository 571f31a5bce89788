"""Scalar reward models: a sequence-classification LM scored at every token and at the end.

Hugging Face's ``*ForSequenceClassification`` decoders pool the score at the last token that
is not ``pad_token_id``. That goes wrong when pad == eos (the eos closing a response is taken
for padding) and needs ``pad_token_id`` in the config at all. tether finds the end from the
attention mask instead, and computes position ids from it, so left- and right-padded
batches give the same scores. The per-token scores are the same linear head applied to
every position's final hidden state (dense-reward shaping, value-style diagnostics).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tether.models.special_ids import missing_pad_id, resolve_pad_id
from tether.ops.masks import pad_rows, position_ids


@dataclass
class RewardOutput:
    """Scores of a padded batch.

    Attributes:
        token_scores: ``float32 [B, T]``, the head's score at each token; 0 at padding.
        end_scores: ``float32 [B]``, the score at the last non-pad token of each row.
        end_index: ``long [B]``, the position of that token.
    """

    token_scores: torch.Tensor
    end_scores: torch.Tensor
    end_index: torch.Tensor


def _score_head(model: nn.Module) -> nn.Linear:
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"model ({type(model).__name__}) has no linear `score` head; pass a decoder "
            "AutoModelForSequenceClassification such as LlamaForSequenceClassification"
        )
    if head.out_features != 1:
        raise ValueError(
            f"model's score head has {head.out_features} outputs, expected 1; build the model with "
            "AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)"
        )
    return head


def _backbone(model: nn.Module) -> nn.Module:
    prefix = getattr(model, "base_model_prefix", None)
    backbone = getattr(model, prefix, None) if isinstance(prefix, str) else None
    if not isinstance(backbone, nn.Module):
        raise TypeError(
            f"model ({type(model).__name__}) exposes no base model through base_model_prefix; "
            "pass a Hugging Face AutoModelForSequenceClassification"
        )
    return backbone


def _check_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        got = getattr(input_ids, "shape", type(input_ids).__name__)
        raise TypeError(f"input_ids must be an integer tensor [B, T], got {got!r}")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must be a tensor of the same shape as input_ids {tuple(input_ids.shape)}, "
            f"got {getattr(attention_mask, 'shape', attention_mask)!r}"
        )
    mask = attention_mask.bool()
    if attention_mask.dtype != torch.bool and not torch.equal(mask.to(attention_mask.dtype), attention_mask):
        raise ValueError("attention_mask must hold only 0/1 (or bool) values; pass the tokenizer's mask")
    empty = (~mask.any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"attention_mask rows {empty} have no valid token; drop empty sequences before scoring"
        )
    return mask


class SequenceRewardModel(nn.Module):
    """Reward model over a Hugging Face sequence classifier with one label.

    Args:
        model: e.g. ``AutoModelForSequenceClassification.from_pretrained(name, num_labels=1)``.
        tokenizer: optional; needed only by ``score_texts``.
        pad_token_id: id used to pad in ``score_texts``; default the tokenizer's pad id, then
            the model's (``tether.models.special_ids``). Never used to find the end of a sequence.
    """

    def __init__(self, model: nn.Module, tokenizer=None, *, pad_token_id: int | None = None) -> None:
        super().__init__()
        _score_head(model)
        _backbone(model)
        # The head stays reachable only through the model, so state_dict lists it once.
        self.model = model
        self.tokenizer = tokenizer
        # Only score_texts pads: a model without a pad id is refused there, not here.
        self.pad_token_id = resolve_pad_id(pad_token_id, model, tokenizer, owner="SequenceRewardModel", required=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> RewardOutput:
        """Score a padded batch ``[B, T]`` (either padding side; mask 1 on real tokens)."""
        mask = _check_batch(input_ids, attention_mask)
        # Positions count real tokens only, so a left-padded row sees the same positions as
        # the right-padded one (HF's default positions would start at the padding).
        positions = position_ids(mask)
        hidden = _backbone(self.model)(
            input_ids=input_ids, attention_mask=mask.long(), position_ids=positions
        ).last_hidden_state
        token_scores = _score_head(self.model)(hidden).squeeze(-1).float().masked_fill(~mask, 0.0)
        positions = torch.arange(mask.shape[-1], device=mask.device)
        end_index = torch.where(mask, positions, -1).amax(dim=-1)
        end_scores = token_scores.gather(1, end_index[:, None]).squeeze(1)
        return RewardOutput(token_scores=token_scores, end_scores=end_scores, end_index=end_index)

    def score_texts(self, texts: Sequence[str]) -> RewardOutput:
        """Tokenize ``texts`` with the wrapped tokenizer, right-pad them and score them."""
        if self.tokenizer is None:
            raise ValueError("score_texts needs a tokenizer: pass tokenizer= to SequenceRewardModel")
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a list of str; wrap a single text as [text]")
        if len(texts) == 0:
            raise ValueError("texts is empty; pass at least one text to score")
        if self.pad_token_id is None:
            raise missing_pad_id("SequenceRewardModel")
        rows = pad_rows([torch.tensor(self.tokenizer(t)["input_ids"], dtype=torch.long) for t in texts],
                        padding_value=self.pad_token_id)
        device = _score_head(self.model).weight.device
        return self.forward(rows.values.to(device), rows.mask.to(device))
