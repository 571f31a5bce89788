"""What a causal LM can take: its vocabulary and its number of positions, checked up front.

Both limits otherwise fail late and opaquely: an id at or past the embedding's rows is a
bare ``IndexError`` inside the embedding (a device-side assert on GPU), and a sequence
longer than ``config.max_position_embeddings`` is an ``IndexError`` on learned-position
models (GPT-2) or, worse, silently extrapolated rotary positions on the others. Scoring and
sampling check their inputs here before the first forward pass; the check reads the id
range and the longest row back to the host in one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class ModelLimits:
    """``vocab``: ids must lie in ``[0, vocab)``; ``max_positions``: longest sequence.

    Either is None when the model does not say (no embedding rows, no config entry).
    """

    name: str
    vocab: int | None
    max_positions: int | None


def _rows(module: object) -> int | None:
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, Tensor) and weight.dim() == 2 else None


def model_limits(model: nn.Module) -> ModelLimits:
    """The vocabulary (fewest rows of input and output embeddings) and position limit."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    sizes = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            sizes.append(_rows(getattr(inner, getter)()))
        except (AttributeError, NotImplementedError):
            continue  # a model that does not expose this embedding: nothing to check
    sizes = [s for s in sizes if s is not None]
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    limit = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None
    source = getattr(config, "name_or_path", "") or ""
    name = type(inner).__name__ + (f" ({source!r})" if source else "")
    return ModelLimits(name=name, vocab=min(sizes) if sizes else None, max_positions=limit)


def check_fits_model(
    model: nn.Module, ids: Tensor, mask: Tensor, *, new_tokens: int = 0, role: str = "tokens"
) -> None:
    """Refuse ids outside the model's vocabulary and rows longer than its positions.

    Args:
        model: the HF causal LM (or PEFT model / adapter-disabled reference) to be run.
        ids: ``long [B, T]`` token ids; only positions where ``mask`` is True are checked.
        mask: ``bool [B, T]`` valid tokens.
        new_tokens: tokens that sampling may append to every row (``max_new_tokens``).
        role: how the error names ``ids`` (e.g. ``"prompt_ids"``).
    """
    limits = model_limits(model)
    if ids.numel() == 0 or (limits.vocab is None and limits.max_positions is None):
        return
    mask = mask.bool()
    valid_ids = ids.masked_fill(~mask, 0)
    low, high, longest = torch.stack(
        [valid_ids.min(), valid_ids.max(), mask.sum(-1).max()]
    ).tolist()
    if limits.vocab is not None and (low < 0 or high >= limits.vocab):
        raise ValueError(
            f"{role}: ids must lie in [0, {limits.vocab}), the vocabulary of {limits.name} "
            f"({limits.vocab} embedding rows), but they span [{low}, {high}] (a vocabulary of at "
            f"least {high + 1}). The tokens come from another tokenizer than this model's: "
            "score them with a model of the same vocabulary (for a reference, e.g. "
            "tether.models.frozen_copy of the policy) or re-tokenise them."
        )
    length = longest + new_tokens
    if limits.max_positions is not None and length > limits.max_positions:
        what = (
            f"the longest row has {longest} tokens"
            if not new_tokens
            else f"the longest prompt has {longest} tokens and max_new_tokens={new_tokens}, so a "
            f"sampled sequence (which is scored afterwards) may reach {length} tokens"
        )
        raise ValueError(
            f"{role}: {what}, but {limits.name} has only {limits.max_positions} positions "
            "(config.max_position_embeddings). Shorten the prompts"
            + (" or lower max_new_tokens" if new_tokens else " or responses")
            + " so every sequence fits, or use a model with a longer context."
        )
