"""Record a finished ``tether train`` run (``make train``'s ``runs/train`` by default) into
``benchmarks/results/default_run.jsonl``: its config, every step's record, the summary and each
held-out problem's correctness before and after. ``tables.py`` builds the default run's
tables from the newest record of each seed.

    make train && python benchmarks/default_run.py            # the default run
    python benchmarks/default_run.py runs/seed1 --note "..."  # another run of the same config
    make train-tools && python benchmarks/default_run.py runs/train-tools --into tool_run   # the tool task's run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results  # noqa: E402

CONFIG_KEYS = ("model", "task", "steps", "seed", "threads", "dtype", "kl_controller", "kl_target", "kl_bound", "kl_push",
               "kl_band", "kl_coef", "prompts_per_step", "group_size", "learning_rate", "eval_size")


def record(run_dir: Path, note: str = "", commit: str = "") -> dict:
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "seed": config["seed"], "kl_push": config.get("kl_push", True), "config": {k: config.get(k) for k in CONFIG_KEYS},
        **_results.stamp(), **({"commit": commit} if commit else {}), "note": note,
        "summary": {k: v for k, v in summary.items() if k not in ("units", "per_problem_before", "per_problem_after")},
        "per_problem_before": summary.get("per_problem_before"), "per_problem_after": summary.get("per_problem_after"),
        "steps": steps, "full_config": config,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", nargs="?", default="runs/train", type=Path)
    parser.add_argument("--note", default="", help="how the run was made (e.g. 'make train in a fresh clone')")
    parser.add_argument("--commit", default="", help="the commit the run ran (default: this checkout's)")
    parser.add_argument("--into", default="default_run",
                        help="the records' file in benchmarks/results (tool_run: make train-tools' run)")
    args = parser.parse_args(argv)
    if not (args.run_dir / "summary.json").is_file():
        raise SystemExit(f"{args.run_dir}: no summary.json; record a finished run (make train writes runs/train).")
    rec = record(args.run_dir, args.note, args.commit)
    _results.write(args.into, rec, key=("seed", "kl_push", "commit", "machine"))
    s = rec["summary"]
    print(f"recorded seed {rec['seed']} at {rec['commit']}: {100 * s['accuracy_before']:.1f} % -> "
          f"{100 * s['accuracy_after']:.1f} %, {s['steps_over_kl_bound']} kept over kl_bound, "
          f"{s.get('steps_rejected', 0)} rejected")


if __name__ == "__main__":
    main()
