"""Reading and writing the entries of an LLM TensorDict: chats, strings and ragged tensors.

Chats and strings are stored as ``NonTensorStack`` entries (one Python object per row), so
they follow indexing, stacking and splitting of the TensorDict. Ragged per-token tensors are
stored either padded (with an explicit ``bool`` mask under ``("masks", ...)``) or as jagged
nested tensors; ``ragged_grid`` (read by ``read_ragged`` and ``tether.llm``'s ``read_grid``)
turns both into ``(values [B, T], mask [B, T])``.

A lazily stacked TensorDict (what TorchRL collectors produce, one unpadded row per
sample) refuses a plain ``get`` of rows with different lengths; ``get_entry`` reads those
entries as jagged nested tensors instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDictBase
from torch import Tensor

from tether.models.chat import validate_chats
from tether.ops import nested_to_padded, padded_to_nested
from tether.ops.checks import check_mask
from tether.ops.masks import repack

Chat = list[dict[str, str]]


NEXT = "next"


def has_key(td: TensorDictBase, key) -> bool:
    """Whether ``td`` holds ``key`` (a leaf or a sub-TensorDict)."""
    return key in td.keys(include_nested=True, leaves_only=False)


def listed_keys(scopes: TensorDictBase | tuple[TensorDictBase, ...]) -> str:
    """The leaf keys of ``scopes`` as one readable list; with two scopes (``td["next"]``, ``td``)
    the first one's keys are shown under ``"next"``."""
    scopes = (scopes,) if isinstance(scopes, TensorDictBase) else scopes
    keys: set[tuple[str, ...]] = set()
    for i, scope in enumerate(scopes):
        prefix = (NEXT,) if i == 0 and len(scopes) == 2 else ()
        for key in scope.keys(include_nested=True, leaves_only=True):
            key = (key,) if isinstance(key, str) else tuple(key)
            if prefix or len(scopes) == 1 or key[0] != NEXT:
                keys.add(prefix + key)
    return "[" + ", ".join(repr(k[0]) if len(k) == 1 else repr(k) for k in sorted(keys)) + "]"


def missing_key(scopes: TensorDictBase | tuple[TensorDictBase, ...], keys, fix: str = "", *, what: str = "") -> KeyError:
    """The one ``KeyError`` for absent TensorDict entries: the key(s), what was expected there,
    where it was looked up, the keys that are present, and the fix."""
    two = isinstance(scopes, tuple) and len(scopes) == 2
    where = "the TensorDict's 'next' entry or its root" if two else "the TensorDict"
    expected = f"{what} " if what else ""
    return KeyError(f"{keys!r}: expected {expected}in {where}, but missing. Present keys: {listed_keys(scopes)}."
                    + (f" {fix}" if fix else ""))


def fetch(td: TensorDictBase, key, what: str, fix: str = ""):
    """``td[key]`` (jagged for ragged rows of a lazy stack), or ``missing_key`` if absent."""
    if not has_key(td, key):
        raise missing_key(td, key, fix, what=what)
    return get_entry(td, key)


def get_entry(td: TensorDictBase, key):
    """``td.get(key)``; rows of a lazy stack with different lengths come back jagged."""
    if not isinstance(td, LazyStackedTensorDict):
        return td.get(key)
    try:
        return td.get(key)
    except RuntimeError:
        return td.get(key, as_nested_tensor=True, layout=torch.jagged)


def write_objects(td: TensorDictBase, key, objects: Sequence) -> None:
    """Store one Python object per row under ``key``."""
    td.set(key, NonTensorStack(*[NonTensorData(o) for o in objects], batch_size=[len(objects)]))


def read_objects(td: TensorDictBase, key, what: str) -> list:
    """The per-row Python objects stored under ``key`` (a KeyError naming it if absent)."""
    if not has_key(td, key):
        raise missing_key(td, key, what=what)
    value = td.get(key)
    if isinstance(value, (NonTensorStack, NonTensorData)):
        items = value.tolist()
        return items if isinstance(items, list) and td.batch_dims else [items]
    raise TypeError(f"{key!r}: expected {what} stored as non-tensor data, got {type(value).__name__}.")


def read_chats(td: TensorDictBase, key) -> list[Chat]:
    return validate_chats(read_objects(td, key, "a list of chats"), name=str(key))


def read_strings(td: TensorDictBase, key) -> list[str]:
    items = read_objects(td, key, "one string per row")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise TypeError(f"{key!r}[{i}]: expected a string, got {type(s).__name__}.")
    return items


def ragged_grid(value: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(values [B, T, ...], mask bool [B, T])`` of a per-token entry: jagged rows right-padded
    (``nested_to_padded``), or a padded entry with its ``mask`` (None: every entry valid)."""
    if value.is_nested:
        padded = nested_to_padded(value, padding_side="right")
        return padded.values, padded.mask
    if mask is None:
        mask = torch.ones(value.shape[:2], dtype=torch.bool, device=value.device)
    return value, mask


def read_ragged(
    td: TensorDictBase, key, mask_key=None, *, required: bool = True
) -> tuple[Tensor, Tensor] | None:
    """``ragged_grid`` of the entry under ``key``, padded with its mask under ``mask_key``.

    A padded entry without a mask under ``mask_key`` is taken as fully valid.
    """
    if not has_key(td, key):
        if required:
            raise missing_key(td, key, what="a per-token tensor")
        return None
    value = get_entry(td, key)
    mask = None
    if not value.is_nested and mask_key is not None and has_key(td, mask_key):
        mask = get_entry(td, mask_key)
        if mask.shape != value.shape[:2]:
            raise ValueError(
                f"{mask_key!r}: expected a mask of shape {tuple(value.shape[:2])} matching {key!r}, "
                f"got {tuple(mask.shape)}."
            )
        mask = check_mask(repr(mask_key), mask)
    return ragged_grid(value, mask)


def write_ragged(
    td: TensorDictBase,
    key,
    values: Tensor,
    mask: Tensor,
    *,
    pad_output: bool,
    padding_side: str,
    mask_key=None,
    pad_value: int | float = 0,
) -> None:
    """Store ``values`` (valid where ``mask``) padded on ``padding_side`` or as jagged rows."""
    if pad_output:
        packed, packed_mask = repack(values, mask, padding_side, padding_value=pad_value)
        td.set(key, packed)
        if mask_key is not None:
            td.set(mask_key, packed_mask)
    else:
        td.set(key, padded_to_nested(values, mask))
        if mask_key is not None:
            td.set(mask_key, padded_to_nested(mask, mask))


def refuse_retokenising(td: TensorDictBase, ids: Tensor, mask: Tensor, input_mode: str) -> None:
    """Raise ``ValueError`` when ``td`` already holds ``("tokens", "full")`` and the rows
    ``ids [B, T]`` (valid where ``mask``) just rendered from ``(input_mode, "full")`` differ
    from them: a scorer must not overwrite the tokens another piece sampled or scored."""
    found = read_ragged(td, ("tokens", "full"), ("masks", "all_attention_mask"), required=False)
    if found is None:
        return
    held = [row[keep].tolist() for row, keep in zip(*found)]
    rendered = [row[keep].tolist() for row, keep in zip(ids, mask)]
    if held == rendered:
        return
    row = next((i for i, (a, b) in enumerate(zip(held, rendered)) if a != b), min(len(held), len(rendered)))
    got = f"{len(rendered[row])} tokens" if row < len(rendered) else f"{len(rendered)} rows"
    had = f"{len(held[row])}" if row < len(held) else f"{len(held)} rows"
    raise ValueError(
        f"('tokens', 'full'): this scorer (input_mode={input_mode!r}) re-renders ({input_mode!r}, 'full') into "
        f"{got} for row {row}, where the batch already holds {had} sampled or scored tokens; it would overwrite "
        "them. Score the batch's own tokens: TransformersWrapper(model, tokenizer, input_mode='tokens', "
        "generate=False), or tether.llm.RetrieveLogProb(wrapper)."
    )
