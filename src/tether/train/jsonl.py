"""JSON-lines files read with the line that does not parse named (file and line number).

A last line without its newline is a write cut short by a killed process and is left out: the
run directory's logs are appended line by line, and such a line's step has no checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonlLineError(ValueError):
    """A line of a JSON-lines file that does not parse: ``path``, ``line`` (1-based), ``reason``."""

    def __init__(self, path: Path, line: int, reason: str) -> None:
        super().__init__(f"{path}: line {line} is not valid JSON ({reason}); the file is damaged: fix or delete "
                         "that line.")
        self.path, self.line, self.reason = path, line, reason


def read_jsonl(path: Path, *, unfinished_last: bool = True) -> list[Any]:
    """The values of ``path``'s non-blank lines ([] when the file is absent); ``unfinished_last``
    drops a last line without its newline. A line that does not parse raises ``JsonlLineError``
    naming the file, the line number and the parser's complaint."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_text().split("\n")
    lines = lines[:-1] if unfinished_last else lines
    values = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            values.append(json.loads(line))
        except ValueError as exc:
            raise JsonlLineError(path, number, str(exc)) from None
    return values
