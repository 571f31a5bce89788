"""tether's modules import one another without a circle.

The graph is built with ``ast`` from every module under ``src/tether``: an edge for each import
of a tether module, at module level or inside a function (a function-local import is still a
dependency, only a later one); imports under ``if TYPE_CHECKING:`` are annotations and left
out. ``from .x import y`` is resolved against the importing module's package, and ``from pkg
import sub`` is an edge to the submodule ``pkg.sub`` when that is a module. A circle is reported
as the modules along it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def modules(src: Path = SRC) -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is a package)}`` of every module under ``src/tether``."""
    out = {}
    for path in sorted((src / "tether").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports(tree: ast.AST, in_function: bool = False) -> list[tuple[ast.stmt, bool]]:
    """Every import statement of ``tree`` with whether it runs inside a function; ``TYPE_CHECKING`` blocks skipped."""
    found = []
    for child in ast.iter_child_nodes(tree):
        if _type_checking(child):
            for other in child.orelse:  # the ``else:`` of ``if TYPE_CHECKING`` runs
                found += imports(ast.Module(body=[other], type_ignores=[]), in_function)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append((child, in_function))
        nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        found += imports(child, nested)
    return found


def targets(node: ast.stmt, name: str, package: bool, known: dict) -> set[str]:
    """The tether modules one import statement of module ``name`` loads."""
    if isinstance(node, ast.Import):
        wanted = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = name.split(".") if package else name.split(".")[:-1]
            base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
        subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
        # ``from pkg import sub``: the submodule; ``from pkg import name``: the package itself
        wanted = subs + ([base] if len(subs) < len(node.names) else [])
    return {t for t in wanted if t in known and t != name}


def import_graph(src: Path = SRC) -> tuple[dict[str, set[str]], list[tuple[str, int]]]:
    """``({module: modules it imports}, [(module, line) of each function-local tether import])``."""
    known = modules(src)
    graph: dict[str, set[str]] = {name: set() for name in known}
    local = []
    for name, (path, package) in known.items():
        for node, in_function in imports(ast.parse(path.read_text())):
            hit = targets(node, name, package, known)
            graph[name] |= hit
            if hit and in_function:
                local.append((name, node.lineno))
    return graph, local


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first search, colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_tether_has_no_import_circle():
    graph, _ = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_graph_sees_local_relative_and_submodule_imports(tmp_path):
    """A hand-made package: ``a`` imports ``b`` inside a function, ``b`` does ``from . import c``,
    ``c`` does ``from pkg import a`` under TYPE_CHECKING (no edge) and ``from .a import x`` in
    its ``else`` (an edge): the circle ``a -> b -> c -> a``; without the else branch, none."""
    pkg = tmp_path / "tether"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    import tether.b\n")
    (pkg / "b.py").write_text("from . import c\n")
    c = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tether import a\n"
         "else:\n    from .a import x\n")
    (pkg / "c.py").write_text(c)
    graph, local = import_graph(tmp_path)
    assert graph["tether.a"] == {"tether.b"} and graph["tether.b"] == {"tether.c"}
    assert local == [("tether.a", 2)]
    assert find_cycle(graph) == ["tether.a", "tether.b", "tether.c", "tether.a"]
    (pkg / "c.py").write_text(c.split("else:")[0])
    graph, _ = import_graph(tmp_path)
    assert graph["tether.c"] == set() and find_cycle(graph) is None
