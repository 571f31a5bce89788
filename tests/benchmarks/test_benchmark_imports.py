"""Every name a benchmark imports from tether (or from a sibling benchmark) exists.

Benchmarks import inside functions so that ``--help`` stays fast, which hides a renamed or
removed name until someone runs the benchmark; this reads each script's ``from X import
name`` statements, wherever they sit, and resolves them.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _imports(path: Path) -> list[tuple[int, str, str]]:
    tree = ast.parse(path.read_text(), str(path))
    return [(node.lineno, node.module, alias.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 for alias in node.names]


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_each_imported_name_exists(script):
    missing = []
    for line, module, name in _imports(BENCHMARKS / script):
        sibling = BENCHMARKS / f"{module}.py"
        if sibling.is_file():
            if name not in _top_level_names(sibling):
                missing.append(f"{script}:{line}: {module}.{name}")
        elif module.split(".")[0] == "tether":
            try:
                found = hasattr(importlib.import_module(module), name) or importlib.util.find_spec(f"{module}.{name}")
            except ModuleNotFoundError:
                found = False
            if not found:
                missing.append(f"{script}:{line}: {module}.{name}")
    assert not missing, "benchmarks import names that do not exist:\n" + "\n".join(missing)
