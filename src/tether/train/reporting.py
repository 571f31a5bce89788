"""How a ``tether`` command reports: a user error as one line on stderr (status 2), and
tether's own warnings as plain ``tether:`` lines.

An error of the user's (bad command line, bad config, a directory holding another run, a damaged
checkpoint, a failing task) prints without a traceback, unless a dependency raised it: then the
traceback follows, as for every error with ``TETHER_TRACEBACK=1``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

from tether.train.tasks import TaskError

# Exceptions that report a problem with the user's input, files or task, not a bug in tether.
USER_ERRORS = (ValueError, KeyError, TaskError, OSError)


def fail(command: str, exc: BaseException) -> int:
    """Report a user error as one line on stderr; exit status 2. An error of these types that a
    dependency raised, not one of tether's checks, may be a bug tether did not guard against: its
    traceback follows the line (as it does for every error with ``TETHER_TRACEBACK=1``)."""
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    print(f"tether {command}: " + " ".join(line.strip() for line in str(text).splitlines()), file=sys.stderr)
    origin = _raised_in(exc)
    if origin is not None or os.environ.get("TETHER_TRACEBACK"):
        if origin is not None:
            print(f"tether {command}: the {type(exc).__name__} above was raised in {origin}, not by a check of "
                  "tether's; if the line does not say what to change, report it with this traceback:", file=sys.stderr)
        traceback.print_exception(exc, file=sys.stderr)
    return 2


def _raised_in(exc: BaseException) -> str | None:
    """The file of a dependency where ``exc`` was raised, or None when tether raised it. The
    standard library counts as its caller: an ``OSError`` of ``open`` or ``Path.read_text`` on a
    user's path is reported by the tether code that opened it."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        where = Path(frame.filename).resolve()
        library = {"site-packages", "dist-packages"} & set(where.parts)
        if frame.filename.startswith("<") or (where.is_relative_to(stdlib) and not library):
            continue
        return None if where.is_relative_to(Path(__file__).resolve().parents[1]) else str(where)
    return None


def _warning_format(python_format: Callable[..., str]) -> Callable[..., str]:
    """tether's own warnings (a skipped damaged checkpoint, a TRL name read) as one plain line, not
    with tether's source line; another library's warning keeps Python's form, naming its file, so
    it is not taken for tether's. A warning is tether's when its category is defined in tether."""

    def format_warning(message, category, filename, lineno, line=None) -> str:
        if category.__module__.partition(".")[0] == "tether":
            return f"tether: {category.__name__}: {message}\n"
        return python_format(message, category, filename, lineno, line)

    return format_warning


@contextlib.contextmanager
def tether_warnings() -> Iterator[None]:
    """Within: warnings print in the form of ``_warning_format``."""
    shown = warnings.formatwarning
    warnings.formatwarning = _warning_format(shown)
    try:
        yield
    finally:
        warnings.formatwarning = shown
