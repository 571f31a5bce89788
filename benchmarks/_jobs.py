"""The process pool the grid benchmarks (frontier, estimators) run their jobs in.

``job_pool(jobs)`` is a spawned ``ProcessPoolExecutor`` (a forked child cannot use CUDA) whose
workers end themselves when the process that started them is gone: a pool's workers otherwise
outlive a SIGTERM or SIGKILL sent to the benchmark alone and keep training for hours, holding the
cores (or the GPU) the next measurement needs. ``jobs=1`` runs each job in this process instead.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from concurrent.futures import Executor, Future, ProcessPoolExecutor

ORPHAN_POLL_S = 1.0  # how often a worker looks for its parent


def job_pool(jobs: int) -> Executor:
    """``jobs`` worker processes that stop with their parent, or this process for ``jobs=1``."""
    if jobs < 1:
        raise ValueError(f"--jobs: expected a whole number >= 1, got {jobs}; give 1 to run in this process.")
    if jobs == 1:
        return InProcess()
    return ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_end_with_parent, initargs=(os.getpid(),))


def _end_with_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:  # an orphan is handed to another process, so its parent id changes
            time.sleep(ORPHAN_POLL_S)
        os._exit(1)  # no clean-up to run: the results go to the parent, which is gone

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


class InProcess(Executor):
    """``--jobs 1``: each job in this process (no spawned start-up), behind the pool's interface."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - handed over as the pool would
            future.set_exception(exc)
        return future
