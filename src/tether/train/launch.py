"""``--nproc N``: the ``tether train`` command runs itself again in N processes under torchrun.

``launch`` starts ``python -m torch.distributed.run --nproc-per-node N ... -m tether.train train
...`` (a copied recipe's ranks run the copy) on a free loopback port, so runs do not collide;
each process then joins the group in ``tether.train.sharding.join_ranks``. Started by torchrun
directly, ``nproc`` is taken from the world size (``settle_nproc``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tether.train.config import TrainConfig


# ------------------------------------------------------------------------------ --nproc N
# The command runs itself again as ``python -m torch.distributed.run --nproc-per-node N --master-addr
# 127.0.0.1 --master-port PORT -m tether.train train ...`` with the same arguments; each process then
# joins the group in ``tether.train.sharding.join_ranks``. Started by torchrun directly (``torchrun
# --nproc_per_node N -m tether.train ...``), ``nproc`` is taken from the world size and a different
# ``--nproc`` is refused. The port is a free one on the loopback interface, so runs do not collide.
LAUNCHED_ENV = "TETHER_LAUNCHED"  # set in the processes ``launch`` starts (``speaks`` reads it)


def world_size() -> int:
    """Processes in the torchrun group this process belongs to (1 when not started by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def settle_nproc(cfg: TrainConfig, *, given: bool) -> TrainConfig:
    """``cfg`` with ``nproc`` equal to the torchrun world size when started by torchrun.

    ``given`` says whether ``nproc`` was set (a flag, or a value other than 1 from a config
    file or the run being resumed); then it must equal the world size.
    """
    world = world_size()
    if world == 1 or cfg.nproc == world:
        return cfg
    if given:
        raise ValueError(f"nproc: {cfg.nproc} learner processes asked for, but torchrun started {world} "
                         f"(WORLD_SIZE={world}); start torchrun with --nproc_per_node {cfg.nproc}, or drop --nproc.")
    return cfg.override({"nproc": world})


def needs_launch(cfg: TrainConfig) -> bool:
    """Whether this process has to start the learner's processes itself."""
    return cfg.nproc > 1 and world_size() == 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_command(argv: list[str], nproc: int, port: int, *, script: str | None = None) -> list[str]:
    """The command that runs ``tether train`` with ``argv`` in ``nproc`` processes on this machine;
    with ``script`` (a copied recipe's file) each process runs ``python script argv`` instead.

    ``--nproc`` is left out: torchrun would read it as its own ``--nproc-per-node`` (argparse
    matches prefixes), and each process takes ``nproc`` from the world size instead.
    """
    words, skip = [], False
    for word in argv:
        if not skip and word != "--nproc" and not word.startswith("--nproc="):
            words.append(word)
        skip = word == "--nproc"
    target = [script] if script else ["-m", "tether.train", "train"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1", f"--master-port={port}", *target, *words]


def launch(argv: list[str], nproc: int, *, script: str | None = None) -> int:
    """Run ``tether train argv`` (or ``python script argv``) in ``nproc`` processes; torchrun's exit status."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), LAUNCHED_ENV: "1"}
    return subprocess.run(torchrun_command(argv, nproc, free_port(), script=script), env=env, check=False).returncode
