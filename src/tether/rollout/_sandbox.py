"""Running a tool call off the rollout's thread, with a time limit and no file or network access.

A tool runs in its own daemon thread; the caller waits at most ``timeout`` seconds. Python
cannot stop a thread, so a tool that overruns keeps running in the background until it
returns, but its result is dropped and the call is reported as timed out.

While a tool runs, an audit hook (``sys.addaudithook``, installed once per process) refuses
the audit events through which Python code reaches files, sockets, processes and foreign
code: ``open`` and the ``os.``, ``shutil.``, ``socket.``, ``subprocess.``, ``urllib.``,
``http.``, ``ctypes.`` families, among others. The hook looks at a thread-local flag set only
in tool threads, so the rest of the process is untouched. This guards against a tool that
reaches for the outside world by mistake; it is not a sandbox against hostile native code.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["BLOCKED_EVENTS", "BLOCKED_EVENT_PREFIXES", "Outcome", "run_guarded"]

BLOCKED_EVENTS = frozenset({"open", "webbrowser.open"})
BLOCKED_EVENT_PREFIXES = (
    "os.", "shutil.", "socket.", "subprocess.", "urllib.", "http.", "ftplib.", "smtplib.",
    "imaplib.", "poplib.", "telnetlib.", "nntplib.", "ctypes.", "glob.", "tempfile.", "sqlite3.",
)

_state = threading.local()
_installed = False
_install_lock = threading.Lock()


def _hook(event: str, args: tuple) -> None:
    if getattr(_state, "guarded", False) and (event in BLOCKED_EVENTS or event.startswith(BLOCKED_EVENT_PREFIXES)):
        raise PermissionError(f"tools may not reach files, the network or processes (audit event {event!r})")


def _install() -> None:
    global _installed
    with _install_lock:
        if not _installed:
            sys.addaudithook(_hook)  # cannot be removed; inert outside tool threads
            _installed = True


@dataclass(frozen=True)
class Outcome:
    """What a guarded call gave: ``value`` on success, else ``error`` (an exception) or ``timed_out``."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


def run_guarded(fn: Callable[..., Any], kwargs: dict[str, Any], timeout: float) -> Outcome:
    """``fn(**kwargs)`` in a guarded daemon thread, waiting at most ``timeout`` seconds."""
    _install()
    box: dict[str, Any] = {}

    def target() -> None:
        _state.guarded = True
        try:
            box["value"] = fn(**kwargs)
        except BaseException as exc:  # any failure of user code goes back to the model
            box["error"] = exc

    thread = threading.Thread(target=target, name="tether-tool", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return Outcome(timed_out=True)
    if "error" in box:
        return Outcome(error=box["error"])
    return Outcome(value=box.get("value"))
