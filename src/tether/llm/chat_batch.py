"""``chat_batch``: the one way to turn a Python list of chats into a ``history`` input."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tensordict import TensorDict
from tensordict.utils import NestedKey

from tether.llm._token_grid import as_key
from tether.models.batch_io import write_objects
from tether.models.chat import validate_chats


def chat_batch(
    chats: Sequence[Sequence[Mapping[str, str]]], *, key: NestedKey = ("history", "full")
) -> TensorDict:
    """A ``TensorDict`` of batch ``[B]`` holding one chat per row under ``key``.

    Args:
        chats: ``B`` chats, each a non-empty list of ``{"role", "content"}`` dicts.
        key: ``("history", "full")`` (default) for complete conversations to score;
            ``("history", "prompt")`` for prompts a generating wrapper completes.

    Returns:
        ``TensorDict`` with batch size ``[B]``; the chats are stored as non-tensor data, so
        they follow indexing, splitting and stacking of the TensorDict.

    Raises:
        TypeError: ``chats`` is not a list of lists of message dicts, or ``key`` is not a key.
        ValueError: ``chats`` or one of its chats is empty.
        KeyError: a message lacks ``role`` or ``content``.
    """
    key = as_key("key", key)
    checked = validate_chats(chats, name="chats")
    if not checked:
        raise ValueError("chats: expected at least one chat, got an empty list.")
    td = TensorDict(batch_size=[len(checked)])
    write_objects(td, key, checked)
    return td
