"""MkDocs hook: an API page lists exactly its package's ``__all__``.

A line ``::: tether.<package>`` (a package directive with no options of its own) gets the
option ``members:`` set to the package's ``__all__``, read from its ``__init__.py``. An
explicit list renders every exported name, documented or not (the registries are plain
dicts), while ``show_if_no_docstring: false`` keeps a class's undocumented fields and
attributes off the page. Names shared with their own submodule (``tether.ops.aggregate``)
are left out here; their page renders them from the module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
DIRECTIVE = re.compile(r"^::: (tether\.\w+)[ \t]*$", re.MULTILINE)


def exported(package: str) -> list[str]:
    """``package.__all__`` without the names that are also its submodules."""
    folder = SRC / Path(*package.split("."))
    tree = ast.parse((folder / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            names = ast.literal_eval(node.value)
            return [n for n in names if not (folder / f"{n}.py").exists()]
    raise ValueError(f"{package} has no literal __all__ for its API page; add one to {folder / '__init__.py'}")


def _with_members(match: re.Match, markdown: str) -> str:
    rest = markdown[match.end():].lstrip("\n")
    if rest.startswith("    options:"):
        return match.group(0)
    names = ", ".join(exported(match.group(1)))
    return f"{match.group(0)}\n    options:\n      members: [{names}]"


def on_page_markdown(markdown: str, page, **_: object) -> str:
    return DIRECTIVE.sub(lambda m: _with_members(m, markdown), markdown)
