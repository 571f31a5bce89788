"""The fixed mmap threshold of CPU runs (``tether.train.host_memory``): blocks at or above it go
back to the OS when freed, where glibc's adaptive threshold keeps them resident; bad values are
refused by name."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tether.train.config import TrainConfig
from tether.train.host_memory import MAX_MMAP_THRESHOLD, fix_mmap_threshold

ROOT = Path(__file__).resolve().parents[2]

# 40 blocks of 2 MiB, each followed by a 512 KiB keeper that stays allocated (so the freed blocks
# are holes inside the heap, not its top, which glibc trims on its own). A 4 MiB block freed first
# raises glibc's adaptive threshold to 4 MiB: the 2 MiB blocks then come from the heap.
PROBE = """
import ctypes, os, sys
from tether.train.host_memory import fix_mmap_threshold
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold(1 << 20)
first = libc.malloc(4 << 20); ctypes.memset(first, 1, 4 << 20); libc.free(first)
base, big, keep = rss(), [], []
for _ in range(40):
    big.append(libc.malloc(2 << 20)); ctypes.memset(big[-1], 1, 2 << 20)
    keep.append(libc.malloc(512 << 10)); ctypes.memset(keep[-1], 1, 512 << 10)
for p in big:
    libc.free(p)
print(rss() - base)
"""


def _growth(mode: str) -> int:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_blocks_above_the_fixed_threshold_leave_the_resident_set():
    """80 MiB of 2 MiB blocks freed: with the threshold fixed at 1 MiB only the 20 MiB of keepers
    stay resident; under glibc's adaptive threshold the 80 MiB stay too (the test is not vacuous)."""
    mib = 1 << 20
    assert _growth("fixed") <= 24 * mib
    assert _growth("adaptive") >= 96 * mib


def test_a_threshold_outside_glibcs_range_is_refused_by_name():
    with pytest.raises(ValueError, match=r"host_mmap_threshold: expected 0\.\.33554432 bytes.*got 33554433"):
        fix_mmap_threshold(MAX_MMAP_THRESHOLD + 1)
    with pytest.raises(ValueError, match="host_mmap_threshold"):
        TrainConfig(host_mmap_threshold=MAX_MMAP_THRESHOLD + 1).validate()
    with pytest.raises(ValueError, match="host_mmap_threshold"):
        TrainConfig(host_mmap_threshold=-1).validate()
    assert fix_mmap_threshold(0) is False  # 0 leaves glibc's own threshold
