"""Argument checks shared by the Ray transforms, the reference service and its client: which
models and how they are built; what a scoring request may hold."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tether.llm.retrieve_kl import resolve_reference
from tether.ops.checks import check_mask, whole_number

__all__ = ["check_batch", "check_group", "check_model_args", "check_token_range"]


def check_model_args(ref_model: Any, ref_model_factory: Any, gen_model: Any = None,
                     gen_model_factory: Any = None) -> None:
    """Exactly one of ref_model / ref_model_factory; at most one of gen_model / gen_model_factory."""
    given_ref = [name for name, value in (("ref_model", ref_model), ("ref_model_factory", ref_model_factory))
                 if value is not None]
    if len(given_ref) == 2:
        raise ValueError(
            "ref_model and ref_model_factory were both given; expected exactly one. Prefer "
            "ref_model_factory (called inside the actor, so no weights are shipped) and drop ref_model."
        )
    if not given_ref:
        raise ValueError(
            "ref_model / ref_model_factory: expected exactly one, got neither. Pass "
            "ref_model_factory=<callable returning a scoring TransformersWrapper> (built inside the "
            "actor) or ref_model=<TransformersWrapper> (pickled and shipped to it)."
        )
    if sum(value is not None for value in (gen_model, gen_model_factory)) > 1:
        raise ValueError(
            "gen_model and gen_model_factory were both given; expected at most one (neither reuses "
            "the log-probs recorded at sampling time). Drop one of them."
        )
    for name, factory in (("ref_model_factory", ref_model_factory), ("gen_model_factory", gen_model_factory)):
        if factory is not None and (isinstance(factory, torch.nn.Module) or not callable(factory)):
            raise TypeError(
                f"{name}: expected a callable returning a TransformersWrapper, got "
                f"{type(factory).__name__}. Pass a built wrapper as {name.removesuffix('_factory')} instead."
            )
    if ref_model is not None:
        resolve_reference(ref_model, None)  # type and scoring-mode checks, before shipping it


def check_group(group: Any, group_rows: Any, rows: int) -> None:
    """``group`` / ``group_rows``: both or neither; the group holds at least this request's rows."""
    if (group is None) != (group_rows is None):
        raise ValueError(
            f"group={group!r}, group_rows={group_rows!r}: expected both or neither (the group's name "
            "and the total rows of its requests)."
        )
    if group_rows is not None:
        whole_number("group_rows", group_rows, low=rows,
                     fix=f"It is the total rows of the group's requests, at least this request's {rows}.")


def check_batch(tokens: Any, mask: Any) -> Tensor:
    """``tokens`` integer ``[B, T]`` and ``mask`` of the same shape, bool or 0/1 integers (a
    tokenizer's attention mask); returns the mask as bool."""
    if not isinstance(tokens, Tensor) or not isinstance(mask, Tensor):
        raise TypeError(
            f"tokens/mask: expected two tensors, got {type(tokens).__name__} and {type(mask).__name__}."
        )
    if tokens.ndim != 2 or tokens.shape != mask.shape:
        raise ValueError(
            f"tokens/mask: expected two [B, T] tensors of the same shape, got {tuple(tokens.shape)} "
            f"and {tuple(mask.shape)}. Pass the batch's ('tokens', 'full') and its attention mask."
        )
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"tokens: expected integer token ids, got {tokens.dtype}. Pass the batch's token ids.")
    return check_mask("mask", mask)


def check_token_range(tokens: Tensor, mask: Tensor, vocab: int | None, what: str) -> None:
    """Token ids at the mask's positions lie in ``[0, vocab)`` (``vocab`` None: only ``>= 0``).

    Positions outside the mask are never scored, so they may hold anything (e.g. -100).
    """
    kept = tokens[mask]
    if not kept.numel():
        return
    low, high = int(kept.min()), int(kept.max())
    if low >= 0 and (vocab is None or high < vocab):
        return
    bad = tokens < 0 if vocab is None else (tokens < 0) | (tokens >= vocab)
    row, col = (int(i) for i in (bad & mask).nonzero()[0])
    bound = f"[0, {vocab})" if vocab is not None else "[0, ...)"
    raise ValueError(
        f"{what}: token ids under the mask must lie in {bound}, the reference's vocabulary, got ids in "
        f"[{low}, {high}] (first bad one: {int(tokens[row, col])} at row {row}, position {col}). "
        "Tokenize with the reference's tokenizer, or mask those positions out."
    )
