"""Every module under src/tether, and every script under benchmarks/, opens with a docstring of at
most 20 lines.

A module docstring says what the module is and, for an algorithm, how it departs from the
paper and why; rationale, tuning history and measurements belong to the docs pages
(docs/design.md, docs/leash.md), where they can be long. A benchmark's docstring says what it
measures and how to run it; how it is measured (what is timed, what is the same for both tools,
where they still differ) is read beside its results, on the page its tables are on (for
example docs/performance.md, docs/gpu.md), so the docstring and the page cannot drift apart.
"""

from __future__ import annotations

import ast

import pytest

from tests.docs.blocks import ROOT

MAX_LINES = 20


def _docstring_lines(path) -> int | None:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    return None if doc is None else len(doc.splitlines())


# tether's package modules, and the benchmark scripts (one folder, no packages).
TREES = {"src/tether": lambda: sorted((ROOT / "src" / "tether").rglob("*.py")),
         "benchmarks": lambda: sorted((ROOT / "benchmarks").glob("*.py"))}


@pytest.mark.parametrize("tree", TREES)
def test_module_docstrings_are_short(tree):
    long = {}
    for path in TREES[tree]():
        lines = _docstring_lines(path)
        if lines is not None and lines > MAX_LINES:
            long[str(path.relative_to(ROOT))] = lines
    assert not long, f"module docstrings over {MAX_LINES} lines (move the rationale to docs/): {long}"


def test_the_count_sees_a_long_docstring(tmp_path):
    """The counter itself: a 21-line docstring is over, a 20-line one is not."""
    over, at = tmp_path / "over.py", tmp_path / "at.py"
    over.write_text('"""' + "\n".join(f"line {i}" for i in range(21)) + '"""\n')
    at.write_text('"""' + "\n".join(f"line {i}" for i in range(20)) + '"""\nx = 1\n')
    assert (_docstring_lines(over), _docstring_lines(at)) == (21, 20)
