"""Chat tokenisation with assistant masks taken from the tokenizer's own chat template.

The mask marks every token the policy is trained on: each assistant turn's content and the
end-of-turn token that closes it. TorchRL stops the mask before that token, so the decision
to stop is never trained; tether includes it. Role headers and the newline ChatML writes
after the end-of-turn token are never masked.

Two ways to find the turns, both from the template as shipped (tether never swaps a
template for one chosen from the model's name, as TorchRL does):

- the template has a ``{% generation %}`` block: ``transformers`` returns the mask itself
  (``return_assistant_tokens_mask=True``); a run of masked tokens followed directly by the
  end-of-turn token is extended over it, for templates whose block stops before that token.
  Every assistant message must come out as one masked run, else the chat is refused;
- otherwise a prompt/response split: assistant turn ``i`` starts where the rendering of
  ``messages[:i]`` with the generation prompt ends, and runs through the first end-of-turn
  (eos) token after that. Each such prefix must be a token prefix of the whole rendering;
  a template that renders earlier turns differently once later ones exist is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Keyword arguments tokenize_chats sets itself; passing them through tokenizer_kwargs would
# silently change what the mask refers to.
_RESERVED_KWARGS = (
    "tokenize",
    "return_dict",
    "return_assistant_tokens_mask",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "return_tensors",
    "padding",
    "truncation",
)
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class ChatTokens:
    """Token ids and assistant masks of a batch of chats, one unpadded row per chat.

    Attributes:
        input_ids: one 1-D ``long`` tensor ``[T_i]`` per chat.
        assistant_mask: one 1-D ``bool`` tensor ``[T_i]`` per chat, True on assistant
            content and on the end-of-turn token closing each assistant turn.
    """

    input_ids: list[torch.Tensor]
    assistant_mask: list[torch.Tensor]


def has_generation_block(template: str) -> bool:
    """Whether a chat template marks assistant text with ``{% generation %}``."""
    return bool(_GENERATION_BLOCK.search(template))


def _template_of(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no chat template (tokenizer.chat_template "
            "is empty); set tokenizer.chat_template to the template the model was trained with "
            "(tether never substitutes one)"
        )
    return tokenizer.get_chat_template()


class CheckedChats(list):
    """Chats ``validate_chats`` has checked (copies of them): passing them on does not check them again."""


def validate_chats(chats: Any, name: str = "chats") -> CheckedChats:
    """The one check of chat input: a list of chats, each a non-empty list of message dicts.

    Every entry point that takes chats (``chat_batch``, reading ``("history", ...)`` from a
    TensorDict, ``tokenize_chats``) calls this, so a fault gets the same exception type and
    message wherever it is found: ``TypeError`` for a wrong type, ``ValueError`` for an empty
    chat, ``KeyError`` for a message without ``role`` or ``content``. Returns copies, marked
    as ``CheckedChats`` so that the stages after the entry (the wrapper reading a batch, then
    tokenizing it) check each chat once.
    """
    if isinstance(chats, CheckedChats):
        return chats
    if isinstance(chats, (str, Mapping)) or not isinstance(chats, Sequence):
        raise TypeError(
            f"{name}: expected a list of chats (each a list of {{'role', 'content'}} dicts), "
            f"got {type(chats).__name__}."
        )
    checked = []
    for k, chat in enumerate(chats):
        if isinstance(chat, Mapping):
            raise TypeError(
                f"{name}[{k}] is a message dict, not a chat: expected a list of chats, each a list "
                "of messages. Wrap a single chat in a list: [chat]."
            )
        if isinstance(chat, str) or not isinstance(chat, Sequence):
            raise TypeError(f"{name}[{k}]: expected a list of message dicts, got {type(chat).__name__}.")
        if len(chat) == 0:
            raise ValueError(f"{name}[{k}] is empty: every chat needs at least one message.")
        for j, message in enumerate(chat):
            if not isinstance(message, Mapping):
                raise TypeError(
                    f"{name}[{k}][{j}]: expected a dict with 'role' and 'content', got {type(message).__name__}."
                )
            missing = [key for key in ("role", "content") if key not in message]
            if missing:
                raise KeyError(f"{name}[{k}][{j}] lacks {missing}: every message needs 'role' and 'content'.")
            for key in ("role", "content"):
                if not isinstance(message[key], str):
                    raise TypeError(
                        f"{name}[{k}][{j}][{key!r}]: expected a str, got {type(message[key]).__name__}."
                    )
        checked.append([dict(message) for message in chat])
    return CheckedChats(checked)


def _check_kwargs(tokenizer_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    kwargs = dict(tokenizer_kwargs or {})
    clash = [key for key in kwargs if key in _RESERVED_KWARGS]
    if clash:
        raise ValueError(
            f"tokenizer_kwargs may not set {clash}: tokenize_chats sets them itself (pass "
            "add_generation_prompt as its own argument; set tokenizer.chat_template to change "
            "the template)"
        )
    return kwargs


def _render_ids(tokenizer, messages, add_generation_prompt: bool, kwargs) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    )


def render_chat_ids(
    tokenizer,
    chat: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = False,
    tokenizer_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of one chat rendered by the tokenizer's own template (no mask)."""
    _template_of(tokenizer)
    checked = validate_chats([chat])[0]
    return _render_ids(tokenizer, checked, add_generation_prompt, _check_kwargs(tokenizer_kwargs))


def _split_mask(tokenizer, chat, index: int, full: list[int], kwargs) -> list[bool]:
    """Assistant mask of one chat by rendering the prompt before each assistant turn."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            "tokenizer.eos_token_id is None; the end of an assistant turn is found as the eos "
            "token, so set tokenizer.eos_token to the template's end-of-turn token"
        )
    mask = [False] * len(full)
    for i, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError(
                f"chats[{index}][0] is an assistant turn; without a {{% generation %}} block the "
                "assistant mask is found from the prompt before each turn, so a chat must not "
                "start with the assistant (prepend a system or user message)"
            )
        prefix = _render_ids(tokenizer, chat[:i], True, kwargs)
        upto = _render_ids(tokenizer, chat[: i + 1], False, kwargs)
        renders = (("messages[:i] with the generation prompt", prefix), ("messages[:i+1]", upto))
        for name, ids in renders:
            if full[: len(ids)] != ids:
                raise ValueError(
                    f"chats[{index}]: the chat template renders {name} (i={i}) differently from the "
                    "start of the whole chat, so assistant turns cannot be located by prompt "
                    "prefixes; use a template with a {% generation %} block around each assistant "
                    "turn's content and end-of-turn token"
                )
        start = len(prefix)
        end = next((t for t in range(start, len(upto)) if full[t] == eos), None)
        if end is None:
            raise ValueError(
                f"chats[{index}][{i}]: no eos token (id {eos}) closes this assistant turn in the "
                "rendered chat; set tokenizer.eos_token to the template's end-of-turn token"
            )
        mask[start : end + 1] = [True] * (end + 1 - start)
    return mask


def _extend_to_eos(mask: list[bool], ids: list[int], eos: int | None) -> list[bool]:
    """Cover the end-of-turn token that directly follows a masked run, if the block left it out."""
    if eos is None:
        return mask
    out = list(mask)
    for t in range(1, len(ids)):
        if mask[t - 1] and not mask[t] and ids[t] == eos:
            out[t] = True
    return out


def _count_runs(mask: list[bool]) -> int:
    return sum(1 for t, value in enumerate(mask) if value and (t == 0 or not mask[t - 1]))


def _generation_mask(tokenizer, chat, index: int, add_generation_prompt: bool, kwargs):
    encoded = tokenizer.apply_chat_template(
        chat,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    ids = list(encoded["input_ids"])
    mask = _extend_to_eos([bool(m) for m in encoded["assistant_masks"]], ids, tokenizer.eos_token_id)
    expected = sum(1 for message in chat if message["role"] == "assistant")
    found = _count_runs(mask)
    if found != expected:
        # E.g. an empty assistant message in a template whose block stops before the
        # end-of-turn token: the block is empty and nothing marks where the turn is.
        raise ValueError(
            f"chats[{index}]: the template's {{% generation %}} blocks mark {found} assistant spans "
            f"for {expected} assistant messages; each assistant turn needs a non-empty block "
            "(include the end-of-turn token in it, or drop empty assistant messages)"
        )
    return ids, mask


def tokenize_chats(
    tokenizer,
    chats: Sequence[Sequence[Mapping[str, str]]],
    *,
    add_generation_prompt: bool = False,
    tokenizer_kwargs: Mapping[str, Any] | None = None,
) -> ChatTokens:
    """Render and tokenize chats with the tokenizer's template, with assistant masks.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        chats: a list of chats; each chat is a list of ``{"role", "content"}`` dicts.
        add_generation_prompt: append the header that opens a new assistant turn (for
            prompts to be completed); the header itself is never masked.
        tokenizer_kwargs: extra keyword arguments for ``apply_chat_template`` (template
            variables such as ``enable_thinking``, ``tools``).

    Returns:
        ``ChatTokens`` with one unpadded row per chat, in input order.
    """
    template = _template_of(tokenizer)
    checked = validate_chats(chats)
    kwargs = _check_kwargs(tokenizer_kwargs)
    use_block = has_generation_block(template)
    input_ids, masks = [], []
    for index, chat in enumerate(checked):
        if use_block:
            ids, mask = _generation_mask(tokenizer, chat, index, add_generation_prompt, kwargs)
        else:
            ids = _render_ids(tokenizer, chat, add_generation_prompt, kwargs)
            mask = _split_mask(tokenizer, chat, index, ids, kwargs)
        input_ids.append(torch.tensor(ids, dtype=torch.long))
        masks.append(torch.tensor(mask, dtype=torch.bool))
    return ChatTokens(input_ids=input_ids, assistant_mask=masks)
