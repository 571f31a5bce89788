"""Finding tool calls in an assistant turn: the formats tether parses, in a registry.

``"hermes"`` (the default) is the format of the Hermes / Qwen2.5 chat templates, and the one
tether documents for templates that define none (the embedded SmolLM2 ChatML template has
no tool format): each call is a JSON object with a ``"name"`` string and an ``"arguments"``
object between ``<tool_call>`` and ``</tool_call>`` tags, e.g.

    <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 86"}}</tool_call>

A turn may hold several calls, run in order. A tag whose body is not such an object, or an
opening tag left unclosed, is a malformed call: it is reported back to the model as an
error, never skipped. A custom format is any callable ``text -> list[ParsedCall]``, passed
as ``tool_format`` or added to ``TOOL_CALL_FORMATS``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tether.ops.checks import lookup

__all__ = ["ParsedCall", "TOOL_CALL_FORMATS", "parse_hermes", "resolve_tool_format"]


@dataclass(frozen=True)
class ParsedCall:
    """One tool call found in a turn: ``name`` and ``arguments``, or ``error`` when malformed."""

    name: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def _parse_body(body: str) -> ParsedCall:
    try:
        data = json.loads(body)
    except ValueError as exc:
        return ParsedCall(error=f"the call is not valid JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ParsedCall(error='expected {"name": "<tool>", "arguments": {...}} inside <tool_call>')
    arguments = data.get("arguments", {})
    if not isinstance(arguments, dict):
        return ParsedCall(name=data["name"], error='"arguments" must be a JSON object')
    return ParsedCall(name=data["name"], arguments=arguments)


def parse_hermes(text: str) -> list[ParsedCall]:
    """Every ``<tool_call>{json}</tool_call>`` of ``text``, in order (unclosed tags are malformed)."""
    calls = []
    for match in _CALL.finditer(text):
        if not match.group(2):
            calls.append(ParsedCall(error="<tool_call> is not closed by </tool_call>"))
        else:
            calls.append(_parse_body(match.group(1).strip()))
    return calls


TOOL_CALL_FORMATS: dict[str, Callable[[str], list[ParsedCall]]] = {"hermes": parse_hermes}


def resolve_tool_format(tool_format: str | Callable[[str], list[ParsedCall]]) -> Callable[[str], list[ParsedCall]]:
    """A parser from a registered format name, or a callable used as it is."""
    if callable(tool_format):
        return tool_format
    return lookup(TOOL_CALL_FORMATS, tool_format, "tool_format")
