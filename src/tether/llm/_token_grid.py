"""Finding per-token entries of an LLM TensorDict and reading them as ``[B, T]`` grids.

The components of ``tether.llm`` read from two places: the root of the TensorDict (where a
policy writes its tokens, masks and sampling log-probs) and, when present, its ``"next"``
entry (where an environment step writes rewards). Outputs go to ``"next"`` when it exists,
else to the root; inputs are looked up there first, then at the root.

A per-token entry is either padded (``[B, T]``, laid out like ``("masks",
"all_attention_mask")`` of the TensorDict holding it) or a jagged nested tensor
(``[B, j]``); rows of a lazy stack with different lengths read as the latter. ``TokenGrid`` holds either as a padded grid plus its valid mask, and knows how
to put a grid of new values back in the same layout. Batches of several dims built as lazy
stacks of lazy stacks (a TorchRL rollout ``[envs, steps]``) run through ``on_rows``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase
from tensordict.utils import NestedKey, unravel_key
from torch import Tensor

from tether.models.batch_io import NEXT, get_entry, has_key, ragged_grid
from tether.ops import padded_to_nested

TOKENS_KEY = ("tokens", "full")
ATTENTION_KEY = ("masks", "all_attention_mask")
ASSISTANT_KEY = ("masks", "all_assistant_mask")


def as_key(name: str, key: NestedKey) -> NestedKey:
    """``key`` in canonical form; a ``TypeError`` naming ``name`` if it is not a nested key."""
    try:
        return unravel_key(key)
    except Exception as err:  # unravel_key raises several types for malformed keys
        raise TypeError(
            f"{name}: expected a string or a tuple of strings (a TensorDict key), got {key!r}."
        ) from err


def target_of(td: TensorDictBase) -> TensorDictBase:
    """Where outputs go: ``td["next"]`` when the TensorDict has one, else ``td`` itself."""
    if NEXT in td.keys():
        nxt = td.get(NEXT)
        if isinstance(nxt, TensorDictBase):
            return nxt
    return td


def scopes_of(td: TensorDictBase) -> tuple[TensorDictBase, ...]:
    """Where inputs are looked up, in order: ``"next"`` (if any), then the root."""
    target = target_of(td)
    return (target,) if target is td else (target, td)


def find(scopes: tuple[TensorDictBase, ...], key: NestedKey) -> TensorDictBase | None:
    """The first scope holding ``key``, or None."""
    return next((scope for scope in scopes if has_key(scope, key)), None)


@dataclass(frozen=True)
class TokenGrid:
    """Values ``[B, T, ...]`` with their valid mask ``bool [B, T]`` and original layout.

    ``nested`` grids were jagged rows, right-padded here; padded grids keep the layout they
    were stored in (any padding side).
    """

    values: Tensor
    valid: Tensor
    nested: bool

    def restore(self, grid: Tensor) -> Tensor:
        """Put ``grid [B, T, ...]`` (aligned with this grid) back in the original layout."""
        if self.nested:
            return padded_to_nested(grid, self.valid)
        return grid


def read_grid(scope: TensorDictBase, key: NestedKey, mask: Tensor | None = None) -> TokenGrid:
    """Read ``key`` of ``scope`` as a grid; ``mask`` is the valid mask of a padded entry."""
    value = get_entry(scope, key)
    if not isinstance(value, Tensor):
        raise TypeError(f"{key!r}: expected a per-token tensor, got {type(value).__name__}.")
    if not value.is_nested and value.dim() < 2:
        raise ValueError(
            f"{key!r}: expected a per-token tensor of shape [B, T] (or jagged [B, j]), got shape "
            f"{tuple(value.shape)}."
        )
    values, valid = ragged_grid(value, None if mask is None else mask.to(value.device))
    return TokenGrid(values=values, valid=valid, nested=value.is_nested)


def read_mask(scopes: tuple[TensorDictBase, ...], key: NestedKey, like: TokenGrid) -> Tensor | None:
    """The boolean mask under ``key`` aligned with ``like``, or None when absent.

    A mask in a different layout from ``like`` (padded vs nested, other shape or row
    lengths) raises a ``ValueError``: combining them would misalign tokens.
    """
    scope = find(scopes, key)
    if scope is None:
        return None
    grid = read_grid(scope, key)
    if grid.nested != like.nested:
        raise ValueError(
            f"{key!r}: stored {'nested' if grid.nested else 'padded'} but the log-probs are "
            f"{'nested' if like.nested else 'padded'}. Write masks and log-probs with the same "
            "pad_output setting."
        )
    same_rows = not like.nested or torch.equal(grid.valid, like.valid.to(grid.valid.device))
    if grid.values.shape != like.valid.shape or not same_rows:
        raise ValueError(
            f"{key!r}: expected a mask of shape {tuple(like.valid.shape)} aligned with the "
            f"log-probs, got {tuple(grid.values.shape)}"
            f"{' with other row lengths' if not same_rows else ''}. Produce masks and log-probs "
            "from the same tokens."
        )
    return grid.values.bool().to(like.valid.device)


def place(values: Tensor, device: torch.device | None) -> Tensor:
    return values if device is None else values.to(device)


def _stored_blocks(td: TensorDictBase) -> list[TensorDictBase]:
    """The one-batch-dim TensorDicts a lazy stack of lazy stacks holds (the stored objects)."""
    if td.batch_dims <= 1:
        return [td]
    if not isinstance(td, LazyStackedTensorDict):
        raise ValueError(
            f"batch_size: expected a batch [B], or a lazy stack of such batches (a TorchRL rollout "
            f"[envs, steps]), got a dense TensorDict of batch size {list(td.batch_size)}. Flatten it "
            "first: out = module(td.reshape(-1)).reshape(td.shape)."
        )
    return [block for inner in td.tensordicts for block in _stored_blocks(inner)]


def on_rows(td: TensorDictBase, step: Callable[[TensorDictBase], TensorDictBase]) -> TensorDictBase:
    """Run ``step`` on ``td`` viewed as a batch ``[B]``; its writes reach ``td``.

    A lazy stack of lazy stacks refuses ``get`` of rows with different lengths even as nested
    tensors (one ragged level only). Its rows are the stored 0-dim TensorDicts, so a flat
    lazy stack over them is a view: one ``step`` scores every row, and what it sets lands in
    the original rows. Stored blocks that are dense ``[b]`` TensorDicts run one at a time.
    """
    if td.batch_dims <= 1:
        return step(td)
    blocks = _stored_blocks(td)
    if all(isinstance(block, LazyStackedTensorDict) for block in blocks):
        step(LazyStackedTensorDict(*[row for block in blocks for row in block.tensordicts], stack_dim=0))
    else:
        for block in blocks:
            step(block)
    return td
