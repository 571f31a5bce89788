"""Dependency internals are reached only from ``tether._compat``.

The scan reads every module under ``src/tether`` with ``ast`` and reports, outside
``_compat.py``: a read or write of an attribute whose name starts with one underscore (not a
dunder) that tether itself never defines, ``getattr``/``setattr``/``hasattr`` with such a
name as a string, and an import from a private module of a dependency. Names tether defines
(functions, classes, module globals, attributes it assigns) are its own; an access through
``self``/``cls`` is always its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tether"
DEPENDENCIES = ("transformers", "peft", "ray", "tensordict", "torchrl", "torch")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def own_private_names(trees: list[ast.AST]) -> set[str]:
    """Every private name the given modules define or assign."""
    own: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                own.update((a.asname or a.name).split(".")[0] for a in node.names)
    return {name for name in own if _private(name)}


def foreign_private_uses(tree: ast.AST, own: set[str]) -> list[tuple[int, str]]:
    """``(line, what)`` for each reach into a dependency's private names in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] in DEPENDENCIES and any(_private(p) for p in parts[1:]):
                found.append((node.lineno, f"from {node.module} import"))
            found += [(node.lineno, f"import {a.name}") for a in node.names if _private(a.name) and parts[0] in DEPENDENCIES]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value not in own):
            found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    return found


def _modules() -> dict[Path, ast.AST]:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(SRC.rglob("*.py"))}


def test_no_module_outside_compat_reaches_into_a_dependency():
    modules = _modules()
    own = own_private_names([tree for path, tree in modules.items() if path.name != "_compat.py"])
    found = [f"{path.relative_to(SRC.parent)}:{line}: {what}"
             for path, tree in modules.items() if path.name != "_compat.py"
             for line, what in foreign_private_uses(tree, own)]
    assert not found, "dependency internals outside tether/_compat.py (move them there):\n" + "\n".join(found)


def test_the_scan_reports_each_kind_of_reach():
    """A snippet with one reach of each kind, and two tether-own private accesses that must pass."""
    snippet = ast.parse(
        "from transformers.utils._private import thing\n"
        "def f(model, x):\n"
        "    a = model.config._attn_implementation\n"
        "    b = getattr(x, '_ragged_idx', 1)\n"
        "    c = self._mine\n"
        "    return x._helper()\n"
    )
    own = own_private_names([ast.parse("def _helper(): pass")])
    assert foreign_private_uses(snippet, own) == [
        (1, "from transformers.utils._private import"),
        (3, "._attn_implementation"),
        (4, "getattr(..., '_ragged_idx')"),
    ]
