"""TensorDict access shared by the objectives: presence, KeyErrors that list keys, ragged reads.

A lazily stacked TensorDict (what TorchRL collectors produce) refuses a plain ``get`` of
rows with different lengths; those entries are read as jagged nested tensors instead.
"""

from __future__ import annotations

from typing import Any

from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from tether.models.batch_io import get_entry


def present(td: TensorDictBase, key: NestedKey) -> bool:
    return key in td.keys(include_nested=True, leaves_only=False)


def missing(td: TensorDictBase, key: NestedKey, what: str, fix: str = "") -> KeyError:
    keys = sorted(str(k) for k in td.keys(include_nested=True, leaves_only=True))
    fix = f" {fix}" if fix else ""
    return KeyError(f"{key!r}: expected {what} in the TensorDict, but the key is missing.{fix} Present keys: {keys}.")


def fetch(td: TensorDictBase, key: NestedKey, what: str, fix: str = "") -> Any:
    """``td[key]``, jagged for ragged rows of a lazy stack; a ``KeyError`` listing keys if absent."""
    if not present(td, key):
        raise missing(td, key, what, fix)
    return get_entry(td, key)
