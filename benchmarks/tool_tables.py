"""docs/tools.md's and the README's tables of the tool task: ``make train-tools``' run
(``tool_run.jsonl``, recorded by ``default_run.py --into tool_run``) and multi-turn sampling's
cost (``multi_turn_cache.jsonl``). ``benchmarks/tables.py`` places them in the pages.
"""

from __future__ import annotations

from typing import Any, Callable

import _results
import multi_turn_cache

PAGE = "docs/tools.md"
COMMAND = "make train-tools && python benchmarks/default_run.py runs/train-tools --into tool_run"


def _nats(kl: float) -> str:
    return f"{max(kl, 0.0):.2f}"  # an exact KL of 0 reads as -1e-9 after rounding; "-0.00" says nothing more


def _provenance(r: dict[str, Any]) -> str:
    return (f"{r['machine']}, {r['date']}, commit {r['commit']}; {r['summary']['seconds_in_steps']:.0f} s in the "
            f"{len(r['steps'])} steps, {r['summary']['seconds_this_process']:.0f} s in the process (`{COMMAND}`).")


def heldout(records: list[dict[str, Any]]) -> str:
    """The newest tool run's held-out set, untrained against trained."""
    if not records:
        return f"No tool run is recorded yet: `{COMMAND}` records one."
    r, s = records[-1], records[-1]["summary"]
    rows = [("accuracy", f"{100 * s['accuracy_before']:.1f} %",
             f"**{100 * s['accuracy_after']:.1f} %** ({s['accuracy_gain_points']:+.1f} points)"),
            ("episodes that call the calculator", f"{s['eval_tool_call_rate_before']:.2f}",
             f"**{s['eval_tool_call_rate_after']:.2f}**"),
            ("calls that fail (malformed, bad arguments)", f"{s['eval_tool_error_rate_before']:.2f}",
             f"{s['eval_tool_error_rate_after']:.2f}"),
            ("exact KL to the reference per answer, greedy / sampled at the training temperature", "0",
             f"{s['eval_kl_per_seq']:.2f} / {s['eval_kl_sampled_per_seq']:.2f} nats"),
            ("kept weights over `kl_bound` / rejected updates", "", f"{s['steps_over_kl_bound']} / {s['steps_rejected']}")]
    lines = [f"| held-out set ({s['eval_size']} products, greedy) | untrained | after {len(r['steps'])} steps |",
             "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines) + "\n\n" + _provenance(r)


STEP_ROWS: tuple[tuple[str, Callable[[dict], str]], ...] = (
    ("reward (sampled episodes)", lambda s: f"{s['reward_mean']:.2f}"),
    ("tool-call rate", lambda s: f"{s['tool_call_rate']:.2f}"),
    ("failed calls", lambda s: f"{s['tool_error_rate']:.2f}"),
    ("exact KL / answer of the step's batch", lambda s: _nats(s["kl_exact_per_seq"])),
    ("the budget's landing (KL of the kept weights)", lambda s: _nats(s["kl_kept_per_seq"])),
    ("the budget's scale kept", lambda s: f"{s['kl_move_scale']:.2f}"),
    ("step time (s)", lambda s: f"{s['step_time']:.0f}"),
)


def steps(records: list[dict[str, Any]]) -> str:
    """The newest tool run, step by step."""
    if not records:
        return f"No tool run is recorded yet: `{COMMAND}` records one."
    run = records[-1]["steps"]
    lines = ["| step | " + " | ".join(str(s["step"]) for s in run) + " |", "|---|" + "---|" * len(run)]
    lines += [f"| {label} | " + " | ".join(cell(s) for s in run) + " |" for label, cell in STEP_ROWS]
    return "\n".join(lines)


TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "tool-run": (PAGE, lambda: heldout(_results.read("tool_run"))),
    "tool-run-steps": (PAGE, lambda: steps(_results.read("tool_run"))),
    "multi-turn-cache": (PAGE, lambda: multi_turn_cache.table(_results.read("multi_turn_cache"))),
    "readme-multi-turn-cache": ("README.md", lambda: multi_turn_cache.table(_results.read("multi_turn_cache"))),
}
