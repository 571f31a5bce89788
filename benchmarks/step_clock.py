"""A timed step's phases and memory: ``PhaseClock`` times the functions a step calls,
``memory_peaks`` reads the process's (and the GPU's) peaks, ``append_step`` logs one step's record.

Shared by ``e2e_grpo.py`` (tether's side), ``e2e_trl.py`` (TRL's side) and ``gpu_profile.py``.
"""

from __future__ import annotations

import json
import time


class PhaseClock:
    """Wall seconds per phase within one step; ``wrap`` times every call of a function (a phase
    called inside another counts in both). On a GPU it also keeps each phase's peak allocated
    memory (``gpu_peaks``), to say where a step's peak falls: torch's peak is reset whenever a
    phase is entered or left, and each interval's peak goes to the innermost phase open in it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.gpu_peaks: dict[str, int] = {}
        self.high = 0  # the step's peak so far, kept across the phases' resets of torch's peak
        self.last: dict[str, object] = {}
        self.open: list[str] = []

    def reset(self) -> None:
        self.seconds, self.gpu_peaks, self.high, self.last, self.open = {}, {}, 0, {}, []

    def _interval(self) -> None:
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        peak = torch.cuda.max_memory_allocated()
        self.high = max(self.high, peak)
        if self.open:
            self.gpu_peaks[self.open[-1]] = max(self.gpu_peaks.get(self.open[-1], 0), peak)
        torch.cuda.reset_peak_memory_stats()

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self._interval()  # what came before belongs to the phase that was open
            self.open.append(name)
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self._interval()
                self.open.pop()
            self.last[name] = result
            return result

        return timed


def memory_peaks(clock: PhaseClock | None = None) -> dict:
    """Peak resident set since the last reset (``VmHWM``) and over the process life; on a GPU the
    step's peak allocated memory (with what ``clock``'s phases saw) and each phase's peak."""
    import resource

    hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    out = {"hwm": hwm, "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    import torch

    if torch.cuda.is_initialized():  # the step's peak GPU memory, then a fresh peak for the next step
        torch.cuda.synchronize()
        out["gpu_peak"] = max(torch.cuda.max_memory_allocated(), clock.high if clock else 0)
        if clock is not None:
            out["gpu_peak_by_phase"] = dict(clock.gpu_peaks)
        torch.cuda.reset_peak_memory_stats()
    return out


def append_step(path: str, record: dict) -> None:
    """``record`` as one JSON line at the end of ``path`` (a child's steps, read back by its parent)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
