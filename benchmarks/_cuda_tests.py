"""pytest plugin for ``gpu_check.py``: keep only the tests that skip without a GPU.

A test counts as CUDA-marked when it carries a ``skipif`` mark whose reason says it needs CUDA
or a GPU (``needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA
GPU")`` in ``tests/train``, the flash-attention packing test in ``tests/models``); a test that
skips where a GPU *is* visible is not one. Every other collected test is deselected. Load it
with ``-p _cuda_tests`` and this folder on PYTHONPATH.
"""

from __future__ import annotations

import re
from pathlib import Path

# Files worth collecting: a skipif mark that mentions CUDA somewhere in its arguments.
MARKED = re.compile(r"skipif\([^)]*cuda", re.IGNORECASE | re.DOTALL)
REASON = re.compile(r"\bneeds?\b[^.;]*\b(cuda|gpu)\b", re.IGNORECASE)


def needs_gpu(item) -> bool:
    """Whether ``item`` has a skipif mark whose reason says it needs CUDA or a GPU."""
    return any(REASON.search(str(mark.kwargs.get("reason", ""))) for mark in item.iter_markers("skipif"))


def marked_files(tests: Path) -> list[Path]:
    """Test files under ``tests`` holding a CUDA skipif mark, sorted."""
    return sorted(p for p in tests.rglob("test_*.py") if MARKED.search(p.read_text(encoding="utf-8")))


def pytest_collection_modifyitems(config, items) -> None:
    kept = [item for item in items if needs_gpu(item)]
    dropped = [item for item in items if not needs_gpu(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
