"""The raw records behind the docs' figures: one JSON object per line in ``benchmarks/results/``.

A benchmark appends (or replaces, by its key fields) one record per run with the machine, the
commit and the date it ran on; ``benchmarks/tables.py`` rebuilds every table and plot from them.
"""

from __future__ import annotations

import datetime
import fcntl
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Iterable

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    """``'<cpu model>, <n> cores'`` of this box (or the GPU a run names itself)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def commit() -> str:
    """The checkout's short commit, with ``+`` when the work tree has changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


def stamp() -> dict[str, str]:
    return {"machine": machine(), "commit": commit(), "date": datetime.date.today().isoformat()}


def run_id() -> str:
    """The UTC second a benchmark's invocation started: the ``run`` every row of it shares."""
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ}"


def version(package: str) -> str | None:
    """``package``'s installed version, None where it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def command(script: str, argv: list[str] | None) -> str:
    """The command line that ran ``script`` (``argv``: its arguments, None for ``sys.argv``'s)."""
    import sys

    return " ".join(["python", f"benchmarks/{Path(script).name}", *(sys.argv[1:] if argv is None else argv)])


def newest_run(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the newest full run: ``quick`` (smoke) rows left out, ``run`` the UTC start."""
    full = [r for r in records if not r.get("quick")]
    newest = max((r["run"] for r in full), default=None)
    return [r for r in full if r["run"] == newest]


def _path(name: str, root: Path | None = None) -> Path:
    """``<root>/<name>.jsonl`` (``root``: ``results/`` unless a test or a GPU call's $OUT), or ``name``
    itself when it is a path ending in ``.jsonl`` (a run's own file)."""
    return Path(name) if name.endswith(".jsonl") else Path(root or RESULTS) / f"{name}.jsonl"


def read(name: str, root: Path | None = None) -> list[dict[str, Any]]:
    """Every record of ``name``'s file (none when the file is missing)."""
    path = _path(name, root)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write(name: str, record: dict[str, Any], key: Iterable[str], root: Path | None = None) -> None:
    """Append ``record`` to ``name``'s file, replacing the record equal on every ``key`` field."""
    key, path = tuple(key), _path(name, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.stem}.lock", "w") as lock:  # runs of one grid write from several processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        kept = [r for r in read(name, root) if any(r.get(k) != record.get(k) for k in key)]
        tmp = path.parent / f".{path.name}.tmp"
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in [*kept, record]))
        tmp.replace(path)


def versions(*packages: str) -> dict[str, str | None]:
    """``{package: installed version}`` (None where it is not installed), read without importing it."""
    return {name: version(name) for name in packages}


def destination(results: Path | None, quick: bool) -> Path | None:
    """Where a benchmark run writes its records: the folder given (``--results``), else
    ``RESULTS`` for a full run and nowhere for a ``--quick`` one (a smoke run leaves the docs'
    records alone)."""
    if results is not None:
        return Path(results)
    return None if quick else RESULTS
