"""Assistant masks from chat templates: both methods agree and cover content plus end-of-turn."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import CHATML, CHATML_GENERATION, make_tokenizer
from tether.models import ChatTokens, has_generation_block, tokenize_chats
from tether.models.chat import CheckedChats, validate_chats

CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3*3?"},
    {"role": "assistant", "content": "9, since 3 threes make nine."},
    {"role": "user", "content": "Say nothing."},
    {"role": "assistant", "content": ""},
]
ASSISTANT = [m["content"] for m in CHAT if m["role"] == "assistant"]

# CHATML_GENERATION with the block closed before <|im_end|>, as many shipped templates do.
GENERATION_WITHOUT_EOS = CHATML_GENERATION.replace(
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}",
    "{% generation %}{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>' }}",
)
# Marks the final message, so an earlier turn renders differently once later turns exist.
MARKS_LAST = CHATML.replace(
    "message['content'] + '<|im_end|>'",
    "message['content'] + ('!' if loop.last else '') + '<|im_end|>'",
)
# Closes turns with <|endoftext|> although the tokenizer's eos is <|im_end|>.
WRONG_EOS = CHATML.replace("'<|im_end|>'", "'<|endoftext|>'")


def runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal [start, end) intervals where ``mask`` is True."""
    out, start = [], None
    for t, value in enumerate(mask.tolist() + [False]):
        if value and start is None:
            start = t
        elif not value and start is not None:
            out.append((start, t))
            start = None
    return out


@pytest.mark.parametrize("template", [CHATML, CHATML_GENERATION], ids=["split", "generation"])
def test_mask_is_each_assistant_content_then_end_of_turn(template):
    tok = make_tokenizer(template)
    out = tokenize_chats(tok, [CHAT])
    ids, mask = out.input_ids[0], out.assistant_mask[0]
    assert ids.dtype == torch.long and mask.dtype == torch.bool and ids.shape == mask.shape
    spans = runs(mask)
    assert [tok.decode(ids[a:b]) for a, b in spans] == [c + "<|im_end|>" for c in ASSISTANT]
    header = tok("<|im_start|>assistant\n")["input_ids"]
    newline = tok("\n")["input_ids"]
    for a, b in spans:
        # Just before each run: the whole role header; just after: the newline ChatML writes
        # after <|im_end|>. Neither is trained on.
        assert ids[a - len(header) : a].tolist() == header
        assert ids[b : b + 1].tolist() == newline
    assert tok.decode(ids) == tok.apply_chat_template(CHAT, tokenize=False)


def test_split_and_generation_block_give_identical_rows():
    chats = [CHAT, CHAT[:3], CHAT[1:5]]
    split = tokenize_chats(make_tokenizer(CHATML), chats)
    block = tokenize_chats(make_tokenizer(CHATML_GENERATION), chats)
    for a, b, c, d in zip(split.input_ids, block.input_ids, split.assistant_mask, block.assistant_mask):
        assert torch.equal(a, b) and torch.equal(c, d)
    # One row per chat in input order: row 1 has one assistant turn, row 2 two.
    assert [len(runs(m)) for m in split.assistant_mask] == [3, 1, 2]


@pytest.mark.parametrize("template", [CHATML, CHATML_GENERATION])
def test_pad_equal_to_eos_changes_nothing(template):
    plain = tokenize_chats(make_tokenizer(template), [CHAT])
    same = tokenize_chats(make_tokenizer(template, pad_is_eos=True), [CHAT])
    assert torch.equal(plain.input_ids[0], same.input_ids[0])
    assert torch.equal(plain.assistant_mask[0], same.assistant_mask[0])


@pytest.mark.parametrize("template", [CHATML, CHATML_GENERATION])
def test_chat_ending_with_user_turn_masks_only_earlier_answers(template):
    tok = make_tokenizer(template)
    chat = CHAT[:4]
    out = tokenize_chats(tok, [chat])
    ids, mask = out.input_ids[0], out.assistant_mask[0]
    assert tok.decode(ids[mask]) == "4.<|im_end|>"
    tail = tok("<|im_start|>user\nAnd 3*3?<|im_end|>\n")["input_ids"]
    assert ids[-len(tail) :].tolist() == tail and not mask[-len(tail) :].any()


@pytest.mark.parametrize("template", [CHATML, CHATML_GENERATION])
def test_generation_prompt_is_appended_and_never_masked(template):
    tok = make_tokenizer(template)
    chat = CHAT[:4]
    plain = tokenize_chats(tok, [chat])
    prompt = tokenize_chats(tok, [chat], add_generation_prompt=True)
    header = tok("<|im_start|>assistant\n")["input_ids"]
    assert prompt.input_ids[0].tolist() == plain.input_ids[0].tolist() + header
    assert torch.equal(prompt.assistant_mask[0][: len(plain.assistant_mask[0])], plain.assistant_mask[0])
    assert not prompt.assistant_mask[0][-len(header) :].any()


def test_generation_block_without_end_of_turn_is_extended_over_it():
    chat = CHAT[:5]
    reference = tokenize_chats(make_tokenizer(CHATML), [chat])
    out = tokenize_chats(make_tokenizer(GENERATION_WITHOUT_EOS), [chat])
    assert torch.equal(out.input_ids[0], reference.input_ids[0])
    assert torch.equal(out.assistant_mask[0], reference.assistant_mask[0])
    assert len(runs(out.assistant_mask[0])) == 2


def test_empty_answer_in_block_without_end_of_turn_is_refused():
    # The third assistant message is "": its block is empty, so nothing locates that turn.
    with pytest.raises(ValueError, match=r"chats\[0\].*mark 2 assistant spans for 3 assistant messages"):
        tokenize_chats(make_tokenizer(GENERATION_WITHOUT_EOS), [CHAT])


def test_generation_block_allows_a_chat_opening_with_the_assistant():
    tok = make_tokenizer(CHATML_GENERATION)
    out = tokenize_chats(tok, [CHAT[2:4]])
    assert tok.decode(out.input_ids[0][out.assistant_mask[0]]) == "4.<|im_end|>"


def test_template_is_used_as_shipped():
    tok = make_tokenizer(CHATML)
    tokenize_chats(tok, [CHAT])
    assert tok.chat_template == CHATML


def test_has_generation_block_spellings():
    assert has_generation_block("{% generation %}x{% endgeneration %}")
    assert has_generation_block("{%- generation -%}x{%- endgeneration %}")
    assert not has_generation_block(CHATML)
    assert not has_generation_block("{{ 'generation' }}")


def test_template_that_rerenders_earlier_turns_is_refused():
    with pytest.raises(ValueError, match=r"chats\[0\].*renders.*generation %\} block"):
        tokenize_chats(make_tokenizer(MARKS_LAST), [CHAT])


def test_turn_not_closed_by_eos_is_refused():
    with pytest.raises(ValueError, match=r"chats\[0\]\[2\].*no eos token \(id 258\)"):
        tokenize_chats(make_tokenizer(WRONG_EOS), [CHAT])


def test_missing_eos_token_is_refused():
    tok = make_tokenizer(CHATML)
    tok.eos_token = None
    with pytest.raises(ValueError, match="eos_token_id is None"):
        tokenize_chats(tok, [CHAT])


def test_split_refuses_a_chat_opening_with_the_assistant():
    with pytest.raises(ValueError, match=r"chats\[0\]\[0\] is an assistant turn"):
        tokenize_chats(make_tokenizer(CHATML), [CHAT[2:4]])


def test_tokenizer_without_template_is_refused():
    with pytest.raises(ValueError, match="no chat template.*set tokenizer.chat_template"):
        tokenize_chats(make_tokenizer(None), [CHAT])


@pytest.mark.parametrize(
    ("chats", "error", "pattern"),
    [
        ("hello", TypeError, "chats: expected a list of chats .*got str"),
        (CHAT, TypeError, r"chats\[0\] is a message dict.*Wrap a single chat in a list: \[chat\]"),
        ([[]], ValueError, r"chats\[0\] is empty"),
        ([CHAT, "hi"], TypeError, r"chats\[1\]: expected a list of message dicts, got str"),
        ([[("user", "hi")]], TypeError, r"chats\[0\]\[0\]: expected a dict"),
        ([[{"role": "user"}]], KeyError, r"chats\[0\]\[0\] lacks \['content'\]"),
        ([[{"role": "user", "content": ["hi"]}]], TypeError, r"chats\[0\]\[0\]\['content'\]: expected a str"),
        ([[{"role": None, "content": "hi"}]], TypeError, r"chats\[0\]\[0\]\['role'\]: expected a str"),
    ],
)
def test_bad_chats_name_the_index(chats, error, pattern):
    with pytest.raises(error, match=pattern):
        tokenize_chats(make_tokenizer(CHATML), chats)


def test_chats_are_checked_once_then_passed_on_as_checked():
    """``validate_chats`` copies what it checked into ``CheckedChats``; handing those to the next
    stage (the wrapper's read, then ``tokenize_chats``) returns them as they are, and mutating
    the caller's original afterwards cannot reach them."""
    original = [[dict(m) for m in CHAT]]
    checked = validate_chats(original)
    assert isinstance(checked, CheckedChats) and checked == [CHAT]
    assert validate_chats(checked) is checked
    original[0][0]["content"] = "changed"
    assert checked[0][0]["content"] == "Answer briefly."
    tokenizer = make_tokenizer(CHATML)
    assert [row.tolist() for row in tokenize_chats(tokenizer, checked).input_ids] == [
        row.tolist() for row in tokenize_chats(tokenizer, [CHAT]).input_ids]


@pytest.mark.parametrize("key", ["chat_template", "add_generation_prompt", "tokenize"])
def test_reserved_tokenizer_kwargs_are_refused(key):
    with pytest.raises(ValueError, match=f"tokenizer_kwargs may not set \\['{key}'\\]"):
        tokenize_chats(make_tokenizer(CHATML), [CHAT], tokenizer_kwargs={key: True})


def test_tokenizer_kwargs_reach_the_template():
    template = CHATML.replace("{% for message", "{{ greeting }}{% for message")
    tok = make_tokenizer(template)
    out = tokenize_chats(tok, [CHAT[:3]], tokenizer_kwargs={"greeting": "hey"})
    assert tok.decode(out.input_ids[0]).startswith("hey<|im_start|>system")
    assert tok.decode(out.input_ids[0][out.assistant_mask[0]]) == "4.<|im_end|>"


@pytest.mark.integration
def test_embedded_tokenizer_masks_both_answers(embedded):
    _, tok = embedded
    template = tok.chat_template
    chat = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Green, like grass."},
    ]
    out = tokenize_chats(tok, [chat, chat[:2]], add_generation_prompt=False)
    assert isinstance(out, ChatTokens)
    ids, mask = out.input_ids[0], out.assistant_mask[0]
    assert not has_generation_block(template) and tok.chat_template == template
    assert [tok.decode(ids[a:b]) for a, b in runs(mask)] == ["Blue.<|im_end|>", "Green, like grass.<|im_end|>"]
    # The shipped template inserts its default system prompt; it is rendered, not trained.
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text == tok.apply_chat_template(chat, tokenize=False)
    assert torch.equal(out.input_ids[1], ids[: len(out.input_ids[1])])
    assert torch.equal(out.assistant_mask[1], mask[: len(out.assistant_mask[1])])
