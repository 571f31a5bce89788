"""Every table that ``benchmarks/tables.py`` builds is in its page and equals what the raw records
under ``benchmarks/results/`` give (``tables.py --check``); a page edited by hand fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tables():
    spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_tables_are_what_the_records_give(capsys):
    assert _tables().main(["--check"]) == 0, capsys.readouterr().out


def test_a_hand_edited_table_is_named(tmp_path):
    """One cell changed in a copy of the leash page: ``rebuild`` names that table as changed."""
    tables = _tables()
    text = (ROOT / "docs" / "leash.md").read_text()
    start = text.index("<!-- table:leash-toy -->")
    edited = text[:start] + text[start:].replace("| 0.5 |", "| 0.25 |", 1)
    _, changed = tables.rebuild(edited, "docs/leash.md")
    assert changed == ["leash-toy"]
