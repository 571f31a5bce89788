"""No module of tether over 400 lines, no function over 60: a reader sees one job at a time.

A function's length runs from its first decorator (or ``def``) to its last line, docstring
included, as ``ast`` reports them; nested functions count inside their parent too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tether"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """``(name, first line, lines)`` of every function and method in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out.append((node.name, first, node.end_lineno - first + 1))
    return out


def test_no_file_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in sorted(SRC.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines (split them by job): {long}"


def test_no_function_over_60_lines():
    long = [f"{p.relative_to(SRC)}:{line} {name} ({n} lines)" for p in sorted(SRC.rglob("*.py"))
            for name, line, n in function_lengths(p.read_text()) if n > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them by job): {long}"


def test_a_function_is_counted_from_its_decorator_to_its_last_line():
    """``@d`` on line 1, ``def f`` on 2, a docstring and two statements: 5 lines; ``g`` inside: 2."""
    source = '@d\ndef f():\n    """Doc."""\n    def g():\n        return 1\n'
    assert sorted(function_lengths(source)) == [("f", 1, 5), ("g", 4, 2)]
