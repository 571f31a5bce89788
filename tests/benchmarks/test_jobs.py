"""benchmarks/_jobs.py: a grid benchmark's workers end when the process that started them is
killed (before, a frontier call stopped by SIGTERM left its workers training for two hours), and
``jobs=1`` runs in this process with the pool's interface."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import _jobs  # noqa: E402

# A benchmark's main in miniature: two workers each write their pid and sleep far past the test.
PARENT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {bench!r})
    from _jobs import job_pool
    from _jobs_sleeper import sleep_with_pid
    if __name__ == "__main__":  # spawned workers import this file again
        with job_pool(2) as pool:
            futures = [pool.submit(sleep_with_pid, {out!r}, i) for i in range(2)]
            time.sleep(600)
""")
SLEEPER = textwrap.dedent("""
    import os, time
    from pathlib import Path
    def sleep_with_pid(folder, i):
        Path(folder, f"{i}.pid").write_text(str(os.getpid()))
        time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by whoever adopted it) has ended too.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def _wait(until, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if until():
            return True
        time.sleep(0.2)
    return until()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_workers_end_when_the_parent_is_killed(tmp_path, sig):
    (tmp_path / "_jobs_sleeper.py").write_text(SLEEPER)
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(bench=str(BENCH), out=str(tmp_path)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, str(script)], env=env)
    pid_files = [tmp_path / f"{i}.pid" for i in range(2)]
    try:
        assert _wait(lambda: all(f.exists() and f.read_text() for f in pid_files), 60), "the workers never started"
        workers = [int(f.read_text()) for f in pid_files]
        assert all(_alive(pid) for pid in workers)
        parent.send_signal(sig)  # to the parent alone, as `pkill -f frontier.py` does
        parent.wait(timeout=30)
        # Each worker looks for its parent every ORPHAN_POLL_S seconds.
        assert _wait(lambda: not any(_alive(pid) for pid in workers), 10 * _jobs.ORPHAN_POLL_S + 5), workers
    finally:
        parent.kill()
        for f in pid_files:
            if f.exists() and f.read_text():
                try:
                    os.kill(int(f.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_one_job_runs_in_this_process_and_hands_over_its_error():
    with _jobs.job_pool(1) as pool:
        assert pool.submit(os.getpid).result() == os.getpid()
        failed = pool.submit(int, "x")
    with pytest.raises(ValueError, match="invalid literal"):
        failed.result()


def test_jobs_below_one_are_refused():
    with pytest.raises(ValueError, match=r"--jobs: expected a whole number >= 1, got 0"):
        _jobs.job_pool(0)
