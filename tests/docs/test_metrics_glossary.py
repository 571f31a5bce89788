"""The logged-metrics page (``docs/reference/metrics.md``) names every key a run writes.

Two short runs on the tiny model, between them writing every optional family of keys: reward
functions, ``--eval-every``, ``--dynamic-sampling`` and a task with tools. Every key of their
``metrics.jsonl`` rows and ``summary.json`` must have a row on the page (a per-function key such
as ``reward/odd_share`` matches the page's ``reward/<name>``), and a summary number's row must
give the unit its ``units`` entry gives, so the page cannot fall behind the code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.train.test_rewards import run_cfg
from tests.train.test_tool_task import cfg as tool_cfg
from tether.train.recipe import train

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "metrics.md"


def glossary(file: str) -> dict[str, str]:
    """The section of ``file`` (``metrics.jsonl`` or ``summary.json``): each documented key (or
    ``<name>`` pattern, as a regex) -> the table row naming it."""
    rows, inside = {}, False
    for line in PAGE.read_text().splitlines():
        if line.startswith("## "):
            inside = f"(`{file}`)" in line
        elif inside and line.startswith("| `"):
            first_cell = line.split("|")[1]
            for key in re.findall(r"`([^`]+)`", first_cell):
                rows[re.escape(key).replace(re.escape("<name>"), r"[^/]+")] = line
    return rows


def row_of(key: str, rows: dict[str, str]) -> str | None:
    return next((row for pattern, row in rows.items() if re.fullmatch(pattern, key)), None)


def undocumented(keys: set[str], rows: dict[str, str]) -> list[str]:
    return sorted(k for k in keys if row_of(k, rows) is None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[Path, set[str]]:
    """Each run directory -> step keys of the optional families it must have written."""
    root = tmp_path_factory.mktemp("glossary")
    (root / "rewards").mkdir()
    train(run_cfg(root / "rewards", steps=2, reward_weights="1,3", eval_every=1, dynamic_sampling=True),
          progress=False)
    train(tool_cfg(root / "tools" / "run"), progress=False)
    return {root / "rewards" / "run": {"reward/odd_share", "eval_accuracy", "eval_reward/odd_share", "groups_kept"},
            root / "tools" / "run": {"tool_call_rate", "turns_per_episode"}}


def test_every_logged_key_has_a_row(runs):
    steps, summary = glossary("metrics.jsonl"), glossary("summary.json")
    for run, family in runs.items():
        step_keys = {k for line in (run / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}
        summary_keys = set(json.loads((run / "summary.json").read_text()))
        assert family <= step_keys, family - step_keys  # the optional families this run is here for were written
        assert not undocumented(step_keys, steps), f"{run.parent.name}: add these to {PAGE.name}'s step table"
        assert not undocumented(summary_keys, summary), f"{run.parent.name}: add these to {PAGE.name}'s summary table"


def test_a_summary_number_has_the_unit_its_file_gives(runs):
    rows = glossary("summary.json")
    for run in runs:
        units = json.loads((run / "summary.json").read_text())["units"]
        wrong = {key: unit for key, unit in units.items() if unit not in (row_of(key, rows) or "")}
        assert not wrong, f"{PAGE.name}: these rows do not give summary.json's unit: {wrong}"


def test_a_missing_key_is_named():
    """The check itself: a key no row names is reported, and a per-function key matches only its pattern."""
    rows = glossary("metrics.jsonl")
    assert "accuracy_before" in glossary("summary.json") and "accuracy_before" not in rows  # sections kept apart
    assert undocumented({"kl_per_seq", "reward/odd_share", "kl_made_up", "reward/a/b"}, rows) == ["kl_made_up", "reward/a/b"]
