"""Freed host memory goes back to the OS during CPU training: a fixed malloc mmap threshold.

glibc serves a block from its heap unless it is at least the mmap threshold, and raises that
threshold to the size of every mapped block freed (up to 32 MiB). After the first loss pass the
activations come from the heap, and the heap keeps what each pass freed: the default step held
about 2.7 GiB resident between its stages against about 1.2 GiB of live tensors, and its loss pass
peaked 0.8 GiB above them (``benchmarks/step_memory.py``, docs/performance.md). A fixed threshold
keeps large blocks mapped, so they return to the OS when freed. ``mallopt`` is glibc's; on another
C library this does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MAX_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit machines (DEFAULT_MMAP_THRESHOLD_MAX)


def fix_mmap_threshold(nbytes: int) -> bool:
    """Map blocks of at least ``nbytes`` (fixed from now on, process-wide); whether the C library took it.

    ``nbytes = 0`` leaves glibc's adaptive threshold as it is (and returns False).
    """
    if not 0 <= nbytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"host_mmap_threshold: expected 0..{MAX_MMAP_THRESHOLD} bytes (glibc's ceiling), got "
                         f"{nbytes}; 0 keeps glibc's own threshold.")
    if nbytes == 0:
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)) == 1)
