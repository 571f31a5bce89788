"""``tether train --workers 2`` as a user runs it: a fresh process that starts its own local Ray
cluster and must leave no Ray process behind; given a ``ray_address`` with nothing behind it,
it fails at once with the reason instead of waiting for ever. No ``ray_cluster`` fixture here
on purpose."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import fields
from pathlib import Path

import pytest

from tests.train.test_recipe import tiny_cfg
from tether.train.config import TrainConfig
from tether.train.metrics import MetricsLog
from tether.train.recipe import train

pytestmark = pytest.mark.ray

_MARK = "TETHER_TEST_RUN"


def marked_pids(mark: str) -> set[int]:
    """Processes whose environment holds ``_MARK=mark``: the run and every process it started
    (Ray's GCS, raylet and workers inherit the driver's environment)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if f"{_MARK}={mark}".encode() in environ.split(b"\0"):
            found.add(int(entry.name))
    return found


def overrides(cfg: TrainConfig) -> list[str]:
    """``key=value`` words for every field where ``cfg`` differs from the defaults."""
    default = TrainConfig()
    return [f"{f.name}={getattr(cfg, f.name)}" for f in fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name)]


def test_cli_train_with_workers_starts_and_stops_its_own_cluster(tmp_path):
    """The test_recipe tiny config, 2 steps, 2 workers, through ``python -m tether.train.cli``:
    exit code 0, two metrics lines with the keys of an in-process run, and, once the process
    has exited, none of the processes it started (Ray's included) is left running."""
    if not Path("/proc/self/environ").exists():
        pytest.skip("needs /proc to find the processes the run started")
    cfg = tiny_cfg(tmp_path / "cli", steps=2, workers=2, checkpoint_every=0)
    mark = uuid.uuid4().hex
    env = {**os.environ, _MARK: mark}
    cmd = [sys.executable, "-m", "tether.train.cli", "train", "--quiet", *overrides(cfg)]
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()
    deadline = time.time() + 240
    while child.poll() is None:
        assert time.time() < deadline, "tether train did not finish in 240 s"
        seen |= marked_pids(mark) - {child.pid}
        time.sleep(0.5)
    output = child.stdout.read()
    assert child.returncode == 0, output
    assert seen, "the run started no other process: was the Ray cluster started at all?"
    deadline = time.time() + 20
    while (left := marked_pids(mark)) and time.time() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind by tether train: {left}"

    # The ReferenceService returns log-probs only, so a Ray run's leash reads the sampled KL.
    local = tiny_cfg(tmp_path / "local", steps=2, workers=0, checkpoint_every=0, kl_signal="sampled")
    train(local, progress=False)
    cli_rows = MetricsLog(tmp_path / "cli" / "metrics.jsonl").read()
    local_rows = MetricsLog(tmp_path / "local" / "metrics.jsonl").read()
    assert [r["step"] for r in cli_rows] == [1, 2] and {r["kl_signal"] for r in cli_rows} == {"sampled"}
    assert [list(r) for r in cli_rows] == [list(r) for r in local_rows]


def test_cli_train_with_an_unreachable_ray_address_fails_with_the_reason(tmp_path):
    """``--workers 1 ray_address=127.0.0.1:<free port>``: nothing listens there (a loopback
    address is dialled as given, ``connect_cluster``), so ``ray.init`` would retry for ever. The run exits non-zero well within the 120 s guard, naming the address and the fix,
    leaves no process behind and no checkpoint in its run directory."""
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe_socket.getsockname()[1]}"
    cfg = tiny_cfg(tmp_path / "cli", steps=1, workers=1, checkpoint_every=0, ray_address=address, ray_timeout=10.0)
    mark = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "tether.train.cli", "train", "--quiet", *overrides(cfg)]
    done = subprocess.run(cmd, env={**os.environ, _MARK: mark}, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"Ray address '{address}': nothing accepts connections at" in done.stderr, done.stderr
    assert "ray start --head" in done.stderr
    assert not marked_pids(mark)
    assert not list((tmp_path / "cli").glob("checkpoints/*"))


def test_a_copied_ray_recipe_runs_as_printed(tmp_path, capsys):
    """``tether cp recipe_ray FILE`` prints ``python FILE --workers N [tether train flags]``; run
    so, the copy trains one step on one worker, and the copy is what ran: its note on the
    sampled KL (``SampledKLNote``, changed in the copy) is the one printed."""
    from tether.train.cli import main

    dest = tmp_path / "my_ray.py"
    assert main(["cp", "recipe_ray", str(dest)]) == 0
    assert f"python {dest} --workers N [tether train flags]" in capsys.readouterr().out
    source, note = dest.read_text(), '"kl_signal=exact: the Ray ReferenceService'
    assert source.count(note) == 1
    dest.write_text(source.replace(note, '"my copy: kl_signal=exact: the Ray ReferenceService'))
    cfg = tiny_cfg(tmp_path / "run", steps=1, workers=1, checkpoint_every=0)
    done = subprocess.run([sys.executable, str(dest), "--quiet", *overrides(cfg)], capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stderr
    assert "SampledKLNote: my copy: kl_signal=exact" in done.stderr
    [record] = MetricsLog(tmp_path / "run" / "metrics.jsonl").read()
    assert record["step"] == 1 and record["kl_signal"] == "sampled"
