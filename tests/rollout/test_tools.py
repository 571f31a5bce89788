"""Tools: the calculator's exact arithmetic and bounds, the call parser, and every failure path
of ``run_tool_call`` coming back as an error turn (never an exception)."""

from __future__ import annotations

import socket
import time

import pytest

from tether.rollout import TOOLS, ParsedCall, Tool, calculator, parse_hermes, register_tool, resolve_tools, run_tool_call
from tether.rollout.calculator import MAX_BITS, MAX_CHARS, MAX_EXPONENT
from tether.rollout.tool_calls import resolve_tool_format


@pytest.mark.parametrize("expression, value", [
    ("347 * 86", 29842),  # 347*86 = 300*86 + 47*86 = 25800 + 4042
    ("(12 + 7) * 431 // 2", 4094),  # 19*431 = 8189; 8189 // 2 = 4094
    ("-7 // 2", -4),  # floor division rounds toward -inf
    ("-7 % 3", 2),  # Python's sign of the divisor: -7 = 3*(-3) + 2
    ("2 ** 64", 18446744073709551616),
    ("123456789 * 987654321", 121932631112635269),  # exact, beyond float precision
    ("+5 - -5", 10),
])
def test_calculator_exact(expression, value):
    assert calculator(expression) == str(value)


@pytest.mark.parametrize("expression, match", [
    ("", "empty"),
    ("1 +", "not valid syntax"),
    ("2.5 * 2", "integer literals"),
    ("True + 1", "integer literals"),
    ("'a' * 3", "integer literals"),
    ("7 / 2", "Div is not allowed"),
    ("__import__('os')", "Call is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("1 // 0", "by zero"),
    ("5 % 0", "by zero"),
    (f"2 ** {MAX_EXPONENT + 1}", "exponent"),
    ("2 ** -1", "exponent"),
    ("(2 ** 64) ** 64", f"{MAX_BITS} bits"),
    ("1+" * (MAX_CHARS // 2) + "1", "characters"),
])
def test_calculator_refuses(expression, match):
    with pytest.raises(ValueError, match=match):
        calculator(expression)


def test_calculator_refuses_non_strings():
    with pytest.raises(TypeError, match="expression: expected a string"):
        calculator(12)


def test_parse_hermes_calls_in_order_and_malformed():
    text = ('a <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call> b '
            '<tool_call>{"name": 3}</tool_call><tool_call>not json</tool_call>'
            '<tool_call>{"name": "x", "arguments": [1]}</tool_call><tool_call>{"name": "y"')
    calls = parse_hermes(text)
    assert calls[0] == ParsedCall("calculator", {"expression": "1+1"})
    assert calls[1].error.startswith('expected {"name"')
    assert "not valid JSON" in calls[2].error
    assert calls[3].name == "x" and "must be a JSON object" in calls[3].error
    assert calls[4].error == "<tool_call> is not closed by </tool_call>"
    assert len(calls) == 5
    assert parse_hermes("The answer is 42.") == []


def test_unknown_tool_format_lists_choices():
    with pytest.raises(ValueError, match=r"tool_format: expected one of 'hermes'.*, got 'json'"):
        resolve_tool_format("json")


def call(name, **arguments):
    return ParsedCall(name, arguments)


def test_run_tool_call_success_and_every_error_kind():
    tools = resolve_tools(["calculator"])
    assert run_tool_call(tools, call("calculator", expression="6*7")).content == "42"
    cases = [
        (ParsedCall(error="bad json"), "malformed", "Error: bad json"),
        (call("search", q="x"), "unknown_tool", "Error: no tool named 'search'; available: ['calculator']"),
        (call("calculator"), "bad_arguments", "missing ['expression']"),
        (call("calculator", expression="1", base=10), "bad_arguments", "unexpected ['base']"),
        (call("calculator", expression=12), "bad_arguments", "'expression' must be str, got int"),
        (call("calculator", expression="1/0"), "tool_error", "Error: ValueError: operator Div is not allowed"),
    ]
    for parsed, kind, text in cases:
        result = run_tool_call(tools, parsed)
        assert result.error == kind and text in result.content and result.content.startswith("Error: ")


def test_timeout_and_bad_results_are_error_turns():
    tools = resolve_tools([
        Tool("slow", lambda: time.sleep(1.0) or "late", timeout=0.05),
        Tool("number", lambda: 3),
        Tool("long", lambda: "x" * 11, max_output_chars=10),
    ])
    start = time.perf_counter()
    slow = run_tool_call(tools, call("slow"))
    assert slow.error == "timeout" and time.perf_counter() - start < 0.9
    assert run_tool_call(tools, call("number")).content == "Error: number returned int, not a string"
    assert "returned 11 characters (limit 10)" in run_tool_call(tools, call("long")).content


def _read_file():
    with open(__file__) as handle:
        return handle.read()


def _connect():
    socket.socket(socket.AF_INET, socket.SOCK_STREAM).connect(("127.0.0.1", 9))
    return "connected"


def _list_dir():
    import os

    return str(os.listdir("."))


@pytest.mark.parametrize("fn", [_read_file, _connect, _list_dir])
def test_tools_reach_neither_files_nor_network(fn, tmp_path):
    result = run_tool_call(resolve_tools([Tool("t", fn)]), call("t"))
    assert result.error == "tool_error" and "PermissionError" in result.content
    # The guard is confined to tool threads: this thread still opens files.
    (tmp_path / "ok.txt").write_text("fine")
    assert _read_file().startswith('"""Tools')


def test_registry_add_and_refuse():
    registry = dict(TOOLS)
    echo = register_tool(Tool("echo", lambda text: text, {"text": str}), registry)
    assert resolve_tools([echo])["echo"] is echo and "echo" not in TOOLS
    with pytest.raises(ValueError, match="'echo' is already registered"):
        register_tool(Tool("echo", lambda text: text, {"text": str}), registry)
    with pytest.raises(ValueError, match=r"tools: expected one of 'calculator'.*, got 'nope'"):
        resolve_tools(["nope"])
    with pytest.raises(TypeError, match="wrap it in a list"):
        resolve_tools("calculator")
    with pytest.raises(TypeError, match="expected types among str, int, float, bool"):
        Tool("t", lambda x: x, {"x": list})
    with pytest.raises(ValueError, match="Tool.timeout of 't': expected a finite number > 0, got 0"):
        Tool("t", lambda: "", timeout=0)
    with pytest.raises(ValueError, match="Tool.timeout of 't': expected a finite number > 0, got inf"):
        Tool("t", lambda: "", timeout=float("inf"))
    with pytest.raises(ValueError, match="Tool.max_output_chars of 't': expected an int >= 1, got 0"):
        Tool("t", lambda: "", max_output_chars=0)
    with pytest.raises(TypeError, match="Tool.max_output_chars of 't': expected an int >= 1, got 9.5 of type float"):
        Tool("t", lambda: "", max_output_chars=9.5)
    with pytest.raises(TypeError, match="expected a callable"):
        Tool("t", "not callable")
