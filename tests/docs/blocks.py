"""The fenced code blocks of the README and the docs pages, in the order a reader meets them.

A block may be preceded (only comment lines between) by markers that tell the test runner
how to run it; a reader of the rendered page does not see them:

- ``<!-- no-run: REASON -->``: not run; the reason says why (GPU, a cluster, minutes of work).
- ``<!-- test-with: ARGS -->``: ARGS are appended to every ``tether train`` of the block (a
  tiny model and two steps where the page shows the real job).
- ``<!-- test-replace: OLD => NEW -->``: OLD is replaced by NEW in the block before it runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RUN_LANGUAGES = ("python", "bash")
# Blocks in these languages are shown, never run (a directory tree, a config file's text).
SHOWN_LANGUAGES = ("", "text", "yaml")
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*(no-run|test-with|test-replace):(.*?)-->\s*$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    no_run: str | None = None
    train_args: str = ""
    replacements: list[tuple[str, str]] = field(default_factory=list)

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def runnable_code(self) -> str:
        code = self.code
        for old, new in self.replacements:
            if old not in code:
                raise ValueError(f"{self.where()}: test-replace text {old!r} is not in the block")
            code = code.replace(old, new)
        return code


def _apply_marker(block: Block, kind: str, value: str) -> None:
    value = value.strip()
    if kind == "no-run":
        if not value:
            raise ValueError(f"{block.where()}: a no-run marker must say why")
        block.no_run = value
    elif kind == "test-with":
        block.train_args = value
    else:
        old, sep, new = value.partition(" => ")
        if not sep:
            raise ValueError(f"{block.where()}: test-replace needs 'OLD => NEW', got {value!r}")
        block.replacements.append((old, new))


def read_blocks(path: Path) -> list[Block]:
    """Every fenced block of one Markdown file, with the markers right before it."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    markers: list[tuple[str, str]] = []
    i = 0
    while i < len(lines):
        marker, fence = _MARKER.match(lines[i]), _FENCE.match(lines[i])
        if marker:
            markers.append((marker.group(1), marker.group(2)))
        elif fence:
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            block = Block(path, start, fence.group(1), "\n".join(body) + "\n")
            for kind, value in markers:
                _apply_marker(block, kind, value)
            blocks.append(block)
            markers = []
        elif lines[i].strip():
            markers = []  # a marker belongs to the block right after it, nothing else
        i += 1
    return blocks


def _nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def reading_order() -> list[Path]:
    """The README first, then the site's pages in the order of its navigation."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return [ROOT / "README.md"] + [ROOT / "docs" / page for page in _nav_pages(config["nav"])]
