"""No module of tether or of its benchmarks over 400 lines, no function over 60: a reader sees one
job at a time.

The benchmarks are held to the same limits as ``src/tether``: they are read as often as the
library (each is the method behind a figure in the docs), and a script that grows a second job
(a second tool's side, a reporting layer, a table registry) splits along it, as ``e2e_grpo.py`` /
``e2e_trl.py`` and ``gpu_check.py`` / ``gpu_stages.py`` did. Their module docstrings are held to
20 lines with tether's in ``tests/docs/test_module_docstrings.py``.

A function's length runs from its first decorator (or ``def``) to its last line, docstring
included, as ``ast`` reports them; nested functions count inside their parent too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tether"
BENCHMARKS = ROOT / "benchmarks"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
# Each tree and its modules: every package module of tether, the benchmark scripts beside each other.
TREES = {"src/tether": lambda: sorted(SRC.rglob("*.py")), "benchmarks": lambda: sorted(BENCHMARKS.glob("*.py"))}


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """``(name, first line, lines)`` of every function and method in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out.append((node.name, first, node.end_lineno - first + 1))
    return out


@pytest.mark.parametrize("tree", TREES)
def test_no_file_over_400_lines(tree):
    files = TREES[tree]()
    assert files, f"no Python files found under {tree}"
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines (split them by job): {long}"


@pytest.mark.parametrize("tree", TREES)
def test_no_function_over_60_lines(tree):
    long = [f"{p.relative_to(ROOT)}:{line} {name} ({n} lines)" for p in TREES[tree]()
            for name, line, n in function_lengths(p.read_text()) if n > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them by job): {long}"


def test_a_function_is_counted_from_its_decorator_to_its_last_line():
    """``@d`` on line 1, ``def f`` on 2, a docstring and two statements: 5 lines; ``g`` inside: 2."""
    source = '@d\ndef f():\n    """Doc."""\n    def g():\n        return 1\n'
    assert sorted(function_lengths(source)) == [("f", 1, 5), ("g", 4, 2)]
