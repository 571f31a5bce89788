"""docs/performance.md's tables, each built from its benchmark's records in ``benchmarks/results/``.

One entry a table: its name in the page's ``<!-- table:NAME -->`` marker, the page, and the
builder (the benchmark's own ``table`` function on its records). ``benchmarks/tables.py`` writes
them all; every builder takes the newest full run and names the command that records it.
"""

from __future__ import annotations

from typing import Callable

import _results
import e2e_tables
import grpo
import logprobs
import sampling
import scoring_tables
import step_memory
import step_profile

PAGE = "docs/performance.md"

TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "step-profile": (PAGE, lambda: step_profile.table(_results.read("step_profile"))),
    "step-profile-ops": (PAGE, lambda: step_profile.ops_table(_results.read("step_profile"))),
    "step-memory": (PAGE, lambda: step_memory.table(_results.read("step_memory"))),
    "sampling": (PAGE, lambda: sampling.table(_results.read("sampling"))),
    "e2e-grpo": (PAGE, lambda: e2e_tables.comparison(_results.read("e2e_grpo"))),
    "e2e-grpo-phases": (PAGE, lambda: e2e_tables.phases(_results.read("e2e_grpo"))),
    "logprobs": (PAGE, lambda: logprobs.table(_results.read("logprobs"))),
    "scoring": (PAGE, lambda: scoring_tables.table(_results.read("scoring"))),
    "scoring-compiled": (PAGE, lambda: scoring_tables.table(_results.read("scoring"), compiled=True)),
    "grpo-loss": (PAGE, lambda: grpo.table(_results.read("grpo_loss"))),
}
