"""Tools a model may call during a rollout: plain callables with a declared argument schema.

A ``Tool`` pairs a function with the names and types of its keyword arguments. ``TOOLS`` is
the registry of shipped tools (``"calculator"``); ``register_tool`` adds one and
``resolve_tools`` turns names (looked up with ``tether.ops.checks.lookup``) or ``Tool``
objects into the mapping a rollout uses.

``run_tool_call`` never raises on what the model wrote: an unknown tool, a malformed call,
arguments that do not match the schema, an exception inside the tool, a result that is not a
string or too long, or a timeout all become a ``ToolResult`` with an ``error`` kind and an
``"Error: ..."`` message that goes back to the model as the tool turn. Tools run in a
guarded thread (``tether.rollout._sandbox``) that may touch neither files nor the network.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tether.ops.checks import lookup, real_number, whole_number
from tether.rollout._sandbox import run_guarded
from tether.rollout.calculator import calculator
from tether.rollout.tool_calls import ParsedCall

__all__ = ["ERROR_KINDS", "TOOLS", "Tool", "ToolResult", "register_tool", "resolve_tools", "run_tool_call"]

# Why a call failed; each kind is counted in the episode statistics.
ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "tool_error", "timeout")


@dataclass(frozen=True)
class Tool:
    """A callable the model may call by ``name``.

    Attributes:
        name: the name the model writes in its call.
        fn: called with keyword arguments only; returns a ``str``.
        parameters: argument name -> Python type (``str``, ``int``, ``float``, ``bool``);
            every argument is required and no other is accepted.
        description: one line telling the model what the tool does (for system prompts).
        timeout: seconds a call may take before it is reported as timed out.
        max_output_chars: a longer result is an error, not silently cut.
    """

    name: str
    fn: Callable[..., str]
    parameters: Mapping[str, type] = field(default_factory=dict)
    description: str = ""
    timeout: float = 2.0
    max_output_chars: int = 500

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Tool.name: expected a non-empty string, got {self.name!r}.")
        if not callable(self.fn):
            raise TypeError(f"Tool.fn of {self.name!r}: expected a callable, got {type(self.fn).__name__}.")
        bad = {k: v for k, v in self.parameters.items() if v not in (str, int, float, bool)}
        if bad:
            raise TypeError(
                f"Tool.parameters of {self.name!r}: expected types among str, int, float, bool, got {bad}."
            )
        real_number(f"Tool.timeout of {self.name!r}", self.timeout, low=0, low_open=True,
                    fix="Pass the seconds a call may take.")
        whole_number(f"Tool.max_output_chars of {self.name!r}", self.max_output_chars, low=1,
                     fix="Pass the longest result, in characters.")


@dataclass(frozen=True)
class ToolResult:
    """The tool turn a call produced: ``content`` for the model, ``error`` the failure kind or None."""

    name: str | None
    content: str
    error: str | None = None


CALCULATOR = Tool(
    "calculator", calculator, {"expression": str},
    description="Exact integer arithmetic: + - * // % ** and parentheses, e.g. {\"expression\": \"347 * 86\"}.",
)
TOOLS: dict[str, Tool] = {"calculator": CALCULATOR}


def register_tool(tool: Tool, registry: dict[str, Tool] | None = None) -> Tool:
    """Add ``tool`` to ``registry`` (default ``TOOLS``); a taken name is refused."""
    registry = TOOLS if registry is None else registry
    if not isinstance(tool, Tool):
        raise TypeError(f"tool: expected a tether.rollout.Tool, got {type(tool).__name__}.")
    if tool.name in registry and registry[tool.name] is not tool:
        raise ValueError(f"tool name {tool.name!r} is already registered; pick another name.")
    registry[tool.name] = tool
    return tool


def resolve_tools(tools: Iterable[str | Tool] | Mapping[str, Tool]) -> dict[str, Tool]:
    """``{name: Tool}`` from registered names and ``Tool`` objects."""
    if isinstance(tools, Mapping):
        tools = list(tools.values())
    if isinstance(tools, (str, Tool)):
        raise TypeError(f"tools: expected a list of tool names or Tool objects, got {tools!r}; wrap it in a list.")
    out: dict[str, Tool] = {}
    for item in tools:
        tool = item if isinstance(item, Tool) else lookup(TOOLS, item, "tools")
        out[tool.name] = tool
    return out


def _error(name: str | None, kind: str, message: str) -> ToolResult:
    return ToolResult(name, f"Error: {message}", kind)


def _check_arguments(tool: Tool, arguments: Mapping[str, Any]) -> str | None:
    missing = [k for k in tool.parameters if k not in arguments]
    extra = [k for k in arguments if k not in tool.parameters]
    if missing or extra:
        return f"{tool.name} takes arguments {list(tool.parameters)}; missing {missing}, unexpected {extra}"
    for key, kind in tool.parameters.items():
        value = arguments[key]
        ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            return f"{tool.name}: argument {key!r} must be {kind.__name__}, got {type(value).__name__}"
    return None


def run_tool_call(tools: Mapping[str, Tool], call: ParsedCall) -> ToolResult:
    """Run one parsed call; every failure comes back as a ``ToolResult`` with an error kind."""
    if call.error is not None:
        return _error(call.name, "malformed", call.error)
    if call.name not in tools:
        return _error(call.name, "unknown_tool", f"no tool named {call.name!r}; available: {sorted(tools)}")
    tool = tools[call.name]
    problem = _check_arguments(tool, call.arguments)
    if problem is not None:
        return _error(tool.name, "bad_arguments", problem)
    outcome = run_guarded(tool.fn, dict(call.arguments), tool.timeout)
    if outcome.timed_out:
        return _error(tool.name, "timeout", f"{tool.name} took longer than {tool.timeout} s")
    if outcome.error is not None:
        return _error(tool.name, "tool_error", f"{type(outcome.error).__name__}: {outcome.error}")
    if not isinstance(outcome.value, str):
        return _error(tool.name, "tool_error", f"{tool.name} returned {type(outcome.value).__name__}, not a string")
    if len(outcome.value) > tool.max_output_chars:
        return _error(tool.name, "tool_error", f"{tool.name} returned {len(outcome.value)} characters "
                      f"(limit {tool.max_output_chars})")
    return ToolResult(tool.name, outcome.value)
