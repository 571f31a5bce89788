"""chat_batch: the chats come back unchanged, in order, under the requested key; bad input."""

from __future__ import annotations

import pytest

from tests.llm.naive import MULTI_TURN, PROMPTS
from tether.llm import chat_batch
from tether.models.batch_io import read_chats


def test_round_trip_and_indexing():
    td = chat_batch(MULTI_TURN)
    assert td.batch_size == (3,)
    assert read_chats(td, ("history", "full")) == MULTI_TURN
    assert read_chats(td[1:], ("history", "full")) == MULTI_TURN[1:]


def test_prompt_key():
    td = chat_batch(PROMPTS, key=("history", "prompt"))
    assert read_chats(td, ("history", "prompt")) == PROMPTS
    assert ("history", "full") not in td.keys(True)


def test_input_is_copied():
    chats = [[{"role": "user", "content": "x"}]]
    td = chat_batch(chats)
    chats[0][0]["content"] = "changed"
    assert read_chats(td, ("history", "full"))[0][0]["content"] == "x"


@pytest.mark.parametrize(
    "chats, error, pattern",
    [
        ({"role": "user", "content": "x"}, TypeError, "chats: expected a list of chats"),
        ([{"role": "user", "content": "x"}], TypeError, r"chats\[0\].*Wrap a single chat"),
        ([[{"content": "x"}]], KeyError, r"chats\[0\]\[0\].*'role' and 'content'"),
        ([[]], ValueError, r"chats\[0\] is empty"),
        ([], ValueError, "at least one chat"),
    ],
)
def test_bad_input(chats, error, pattern):
    with pytest.raises(error, match=pattern):
        chat_batch(chats)


def test_bad_key():
    with pytest.raises(TypeError, match="key"):
        chat_batch(PROMPTS, key=3)
