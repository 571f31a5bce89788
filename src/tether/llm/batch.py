"""``chat_batch``: the one way to turn a Python list of chats into a TensorDict input."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tensordict import TensorDict

from tether.models.batch_io import validate_chats, write_objects


def chat_batch(chats: Sequence[Sequence[Mapping[str, str]]], *, key=("history", "full")) -> TensorDict:
    """A ``TensorDict`` of batch size ``[B]`` holding one chat per row under ``key``.

    Each chat is a list of ``{"role", "content"}`` messages. Use ``key=("history", "prompt")``
    for prompts a generating ``TransformersWrapper`` should complete, and the default
    ``("history", "full")`` for conversations to score.
    """
    valid = validate_chats(chats)
    td = TensorDict(batch_size=[len(valid)])
    write_objects(td, key, valid)
    return td
