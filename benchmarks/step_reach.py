"""How many tether modules one GRPO step reaches: the modules whose functions it calls.

Builds the run of a tiny config (the 2-layer random ``tiny`` model, the default arithmetic
task and leash, 2 prompts x 3 answers of 6 tokens; what the recipe tests run), then calls
``tether.train.recipe.train_step(run, 0)`` once under ``sys.setprofile``. Counted: every
Python function or method called from the first call into ``train_step`` to its return,
by the module its code is defined in (``f_globals["__name__"]``). Not counted: the run's set-up
before the step, an import the step triggers (its module bodies and what they call), C functions.
Printed: the number of distinct ``tether.*`` modules and of ``tether.train.*`` ones, then
each module with its number of calls. A measure of how many files a reader follows to see
one step, not of speed.

    python benchmarks/step_reach.py [--out DIR] [--json]    # a few seconds on one core
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

from tether.train import recipe
from tether.train.config import TrainConfig


def tiny_config(out: Path) -> TrainConfig:
    """The tests' tiny run (tests/train/test_recipe.py ``tiny_cfg``) on the default task and leash."""
    return TrainConfig(model="tiny", steps=1, out=str(out), prompts_per_step=2, group_size=3, max_new_tokens=6,
                       micro_batch_size=4, eval_size=4, eval_max_new_tokens=6, lora_rank=0, learning_rate=1e-3,
                       threads=1)


def step_reach(out: Path) -> Counter:
    """Calls per module during one ``train_step`` of the tiny run written under ``out``."""
    run = recipe.build_run(tiny_config(out), fresh=True)
    calls: Counter = Counter()
    importing = 0  # module bodies running: an import the step triggered, whose calls are not the step's

    def profile(frame, event, arg) -> None:
        nonlocal importing
        if frame.f_code.co_name == "<module>":
            importing += {"call": 1, "return": -1}.get(event, 0)
        elif event == "call" and not importing:
            calls[frame.f_globals.get("__name__", "?")] += 1

    sys.setprofile(profile)
    try:
        recipe.train_step(run, 0)
    finally:
        sys.setprofile(None)
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="Run directory to build the run in (default: a temporary one).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of the table.")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        calls = step_reach(Path(args.out) if args.out else Path(tmp) / "run")
    tether = {m: n for m, n in sorted(calls.items()) if m == "tether" or m.startswith("tether.")}
    train = [m for m in tether if m.startswith("tether.train.")]
    if args.json:
        print(json.dumps({"tether_modules": len(tether), "train_modules": len(train), "calls": tether}))
        return 0
    print(f"one train_step reaches {len(tether)} tether modules ({len(train)} of them tether.train.*):")
    for module, n in tether.items():
        print(f"  {module:45s} {n:7d} calls")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
