"""Run the ``Examples`` sections of the public pieces' docstrings (doctest), one piece at a time.

Shared by ``tests/test_docstring_examples.py`` and the Ray pieces' ``tests/ray/test_docstring_examples.py``
(those need the session's local cluster). A piece listed without an example fails.
"""

from __future__ import annotations

import doctest
import importlib

FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS


def run_examples(dotted: str) -> None:
    """Run every example in the docstring of ``dotted`` (``package.Name``) in its module's globals."""
    package, name = dotted.rsplit(".", 1)
    obj = getattr(importlib.import_module(package), name)
    module = importlib.import_module(obj.__module__)
    finder = doctest.DocTestFinder(recurse=False)
    found = [t for t in finder.find(obj, dotted, module=module, globs=dict(vars(module))) if t.examples]
    if not found:
        raise AssertionError(f"{dotted}: its docstring has no Examples section (>>> lines)")
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in found:
        runner.run(test, out=report.append)
    if runner.summarize(verbose=False).failed:
        raise AssertionError(f"{dotted}: docstring examples failed:\n" + "".join(report))
