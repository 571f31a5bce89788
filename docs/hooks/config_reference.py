"""MkDocs hook: renders the configuration reference from ``TrainConfig`` at build time.

``docs/reference/config.md`` holds the marker ``<!-- config-fields -->``; this hook replaces it
with one row per ``TrainConfig`` field (CLI flag, default, the names a choice field
accepts, and the field's help text, which is also ``tether train --help``). The page is never
hand-edited, so it cannot drift from the code.
"""

from __future__ import annotations

from dataclasses import fields

MARKER = "<!-- config-fields -->"


def config_table() -> str:
    """The Markdown table of every ``TrainConfig`` field, in declaration order."""
    from tether.train.config import TrainConfig, config_choices

    choices = config_choices()
    rows = ["| flag | default | accepts | what it does |", "|---|---|---|---|"]
    for f in fields(TrainConfig):
        flag = f"--{f.name.replace('_', '-')}"
        default = "" if f.default == "" else f"`{f.default}`"
        if f.name in choices:
            accepts = ", ".join(f"`{name}`" for name in choices[f.name])
        else:
            accepts = "switch" if isinstance(f.default, bool) else type(f.default).__name__
        text = f.metadata["help"].replace("|", "\\|")
        rows.append(f"| `{flag}` | {default} | {accepts} | {text} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, **_: object) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, config_table())
