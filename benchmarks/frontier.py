"""Accuracy against held-out KL, and what it costs elsewhere: constant beta, the budget, best-of-n.

Each trained point is a default ``tether train`` run (the embedded model, 16 steps) with only the
leash changed and 500 held-out problems: constant beta in {0, 0.05, 0.1, 0.2, 0.3}, the budget at
targets 1-4 plain and with ``kl_push``, ``kl_adaptive_lr`` or ``weight_average``, beta 0 landed on
1-4 at the end (``final_kl_target``), the moving reference (``budget-moving-*``, ``-tight-`` within 2x
the target of the original) and, fully fine-tuned, constant beta and the moving reference again
(``full-*``). After training, the forgetting axis (``tether.train.forgetting``): the exact KL on
answers sampled for general chat prompts, the share of rule-checked instructions followed;
``best-of-n-N``: 32 answers per held-out problem sampled from the untrained policy, the best of
the first N by the task's reward, at KL log N - (N-1)/N; ``base``: the untrained policy (greedy).
One JSON line per (point, seed) to ``benchmarks/results/frontier.jsonl``; ``tables.py`` builds docs.

A (point, seed) already recorded in the same mode is skipped, so calls fill the grid in parts;
``--budget-seconds`` stops starting runs that would end after it. ``--reduced`` (CPU: 3 seeds,
150 held-out problems, 64 chat prompts, 16 draws) and ``--quick`` (tiny model, 2 steps: the test)
label their records ``mode``.

    python benchmarks/frontier.py --device cuda --dtype bfloat16 --threads 1 --jobs 16 --budget-seconds 480
    python benchmarks/frontier.py --reduced --only constant-0.1,budget-t2 --seeds 0
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _results
from _jobs import job_pool

RESULTS_NAME = "frontier"
KEY = ("point", "seed", "mode")
BEST_OF_N = (1, 2, 4, 8, 16, 32)


def _budget(t: float, push: bool) -> dict[str, Any]:
    # The ceiling kl_bound must hold the band's top, 1.25 x the target: target 4 runs with a ceiling of 5.
    return {"kl_controller": "budget", "kl_target": t, "kl_bound": max(4.0, 1.25 * t), "kl_push": push}


# The EMA's decay for 16 steps: it spans about 1 / (1 - mu) = 5 steps and lags the raw weights by
# mu / (1 - mu) = 4, while the initial weights keep 0.8**16 = 3 % of it; 0.9 would keep 19 % of the
# start and lag 9 of the 16 steps, mostly pulling the policy back toward the reference, the leash's job.
AVERAGE_DECAY = 0.8
TARGETS = (1.0, 2.0, 3.0, 4.0)
CONSTANT_BETAS = (0.0, 0.05, 0.1, 0.2, 0.3)
FULL = {"lora_rank": 0}  # full fine-tuning: another model class, so its points have a curve of their own

# Point -> config overrides; None: a variant whose config fields have not landed yet (named, skipped).
GRID: dict[str, dict[str, Any] | None] = {
    **{f"constant-{b:g}": {"kl_controller": "constant", "kl_coef": b} for b in CONSTANT_BETAS},
    **{f"budget-t{t:g}": _budget(t, False) for t in TARGETS},
    **{f"budget-push-t{t:g}": _budget(t, True) for t in TARGETS},
    **{f"budget-lrfollow-t{t:g}": {**_budget(t, False), "kl_adaptive_lr": True} for t in TARGETS},
    **{f"budget-avg-t{t:g}": {**_budget(t, False), "weight_average": AVERAGE_DECAY} for t in TARGETS},
    # beta 0 trained freely, then moved once along the line to the reference to land on t (WiSE-FT).
    **{f"constant-0-land-t{t:g}": {"kl_controller": "constant", "kl_coef": 0.0, "final_kl_target": t} for t in TARGETS},
    **{f"full-constant-{b:g}": {"kl_controller": "constant", "kl_coef": b, **FULL} for b in CONSTANT_BETAS},
    **{f"budget-moving-t{t:g}": {**_budget(t, False), "reference_move": "reset"} for t in TARGETS},
    **{f"full-budget-moving-t{t:g}": {**_budget(t, False), "reference_move": "reset", **FULL} for t in TARGETS},
    # The moving reference held near the curve's range: the cumulative budget to the original at 2x the
    # target, the ceiling with it (at the default 8 nats the runs drifted 3-5 nats out, beyond beta 0).
    **{f"budget-moving-tight-t{t:g}": {**_budget(t, False), "reference_move": "reset", "kl_bound": 2 * t,
                                       "reference_move_budget": 2 * t} for t in TARGETS},
    "best-of-n": {},
}
# Longer runs, where a constant beta drifts and a moving reference should pay: the same families at
# LONG_STEPS steps, fewer points each (three times a 16-step run's cost), on curves of their own.
LONG_STEPS = 48
LONG_TARGETS, LONG_BETAS = (1.0, 3.0), (0.0, 0.05, 0.1, 0.3)
GRID |= {
    **{f"long-constant-{b:g}": {**GRID[f"constant-{b:g}"], "steps": LONG_STEPS} for b in LONG_BETAS},
    **{f"long-{family}-t{t:g}": {**GRID[f"{family}-t{t:g}"], "steps": LONG_STEPS}
       for family in ("budget", "budget-avg", "budget-moving") for t in LONG_TARGETS},
}


@dataclass(frozen=True)
class Mode:
    """How big one run is: the label its records carry and what it spends."""

    name: str
    seeds: str
    model: str = "default"
    eval_size: int = 500
    chat_prompts: int | None = None  # None: every prompt of the file
    chat_tokens: int = 48
    draws: int = 32
    train: tuple[tuple[str, Any], ...] = ()  # config overrides of the mode itself

    @property
    def reduced(self) -> bool:
        return self.name != "full"


MODES = {
    "full": Mode("full", "0,1,2,3,4,5,6,7"),
    "reduced": Mode("reduced", "0,1,2", eval_size=150, chat_prompts=64, draws=16),
    "quick": Mode("quick", "0,1", model="tiny", eval_size=6, chat_prompts=4, chat_tokens=6, draws=4,
                  train=(("steps", 2), ("prompts_per_step", 2), ("group_size", 3), ("max_new_tokens", 6),
                         ("micro_batch_size", 6), ("eval_max_new_tokens", 6))),
}


def _cfg(point: str, seed: int, mode: Mode, args: argparse.Namespace):
    from tether.train.config import TrainConfig
    from tether.train.flags import parse_overrides

    base = TrainConfig(model=mode.model, seed=seed, threads=args.threads, device=args.device, dtype=args.dtype,
                       out=str(Path(args.out) / mode.name / f"{point}-s{seed}"), overwrite=True,
                       eval_size=mode.eval_size, checkpoint_every=0)
    sets = parse_overrides(args.set)
    # The mode's sizes win over a point's (``--quick`` runs a long point for its 2 steps too).
    return base.override({**(GRID[point] or {}), **dict(mode.train), **sets})


def trained_point(point: str, seed: int, mode: Mode, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train one (point, seed) and measure it: held-out accuracy and KL, forgetting."""
    from tether.train import forgetting
    from tether.train.metrics import eval_seed
    from tether.train.recipe import build_run, train
    from tether.train.variants import original_model

    cfg, start = _cfg(point, seed, mode, args), time.perf_counter()
    run = build_run(cfg, fresh=True)
    summary = train(cfg, run=run, progress=False)
    # To the model the run started from: a moved reference is not it.
    lost = forgetting.measure(run.models.policy, original_model(run), run.models.tokenizer, run.task,
                              prompts=mode.chat_prompts, max_new_tokens=mode.chat_tokens, temperature=cfg.temperature,
                              seed=eval_seed(seed, cfg.steps) + 1)
    return [{
        "point": point, "seed": seed, "kl_coef": summary["final_kl_coef"], "kl_controller": cfg.kl_controller,
        "kl_target": cfg.kl_target if cfg.kl_controller != "constant" else None, "kl_push": cfg.kl_push,
        "heldout_accuracy": summary["accuracy_after"], "accuracy_before": summary["accuracy_before"],
        "heldout_kl_sampled_per_seq": summary["eval_kl_sampled_per_seq"],
        "heldout_kl_greedy_per_seq": summary["eval_kl_per_seq"],
        "train_kl_exact_per_seq": summary["final_train_kl_exact_per_seq"], "steps": cfg.steps,
        "steps_rejected": summary["steps_rejected"], "steps_over_kl_bound": summary["steps_over_kl_bound"],
        "per_problem": summary["per_problem_after"], **_forgetting_fields(lost), "lora_rank": cfg.lora_rank,
        "final_interpolation": summary.get("final_interpolation"), **pulled_steps(Path(cfg.out)),
        "seconds": time.perf_counter() - start,
    }]


def pulled_steps(run_dir: Path) -> dict[str, list[dict[str, float]]]:
    """The steps whose kept weights were moved back, from the run's ``metrics.jsonl``: ``pulled``,
    along the line to the reference (the budget's move or the ceiling's pull: ``kl_move_scale`` < 1),
    and ``pulled_to_base``, by the moving reference's cumulative budget (``kl_to_base_scale`` < 1)."""
    from tether.train.metrics import MetricsLog

    rows = MetricsLog(run_dir / "metrics.jsonl").read()
    return {
        "pulled": [{"step": r["step"], "kl_before": r["kl_move_before_per_seq"], "scale": r["kl_move_scale"],
                    "kl_kept": r["kl_kept_per_seq"]} for r in rows if r.get("kl_move_scale", 1.0) != 1.0],
        "pulled_to_base": [{"step": r["step"], "scale": r["kl_to_base_scale"], "kl_kept": r["kl_to_base_per_seq"]}
                           for r in rows if r.get("kl_to_base_scale", 1.0) != 1.0],
    }


def _forgetting_fields(lost) -> dict[str, Any]:
    return {"forgetting_kl_sampled_per_seq": lost.kl_sampled_per_seq, "capability_rate": lost.capability_rate,
            "capability_per_rule": lost.capability_per_rule, "chat_prompts": lost.prompts}


def best_of_n_points(seed: int, mode: Mode, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The untrained policy: ``base`` (greedy accuracy, its capability) and best-of-n for every n."""
    from tether.train import forgetting
    from tether.train.best_of_n import best_of_n_correct, best_of_n_kl, sample_scored
    from tether.train.metrics import evaluate
    from tether.train.recipe import build_run

    cfg, start = _cfg("best-of-n", seed, mode, args), time.perf_counter()
    run = build_run(cfg, fresh=True)
    policy, tokenizer = run.models.policy, run.models.tokenizer
    greedy = evaluate(policy, None, tokenizer, run.task, run.held_out, max_new_tokens=cfg.eval_max_new_tokens,
                      temperature=cfg.temperature, with_kl=False, reward=run.reward)
    lost = forgetting.measure(policy, run.models.reference, tokenizer, run.task, prompts=mode.chat_prompts,
                              max_new_tokens=mode.chat_tokens, temperature=cfg.temperature, seed=seed)
    rewards, correct = sample_scored(policy, tokenizer, run.task, run.held_out, samples=mode.draws,
                                     max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                     seed=1_000 + seed)
    common = {"seed": seed, "kl_coef": None, "train_kl_exact_per_seq": None, "steps": 0}
    records = [{**common, "point": "base", "heldout_accuracy": greedy.accuracy, "heldout_kl_sampled_per_seq": 0.0,
                "per_problem": greedy.per_problem, **_forgetting_fields(lost)}]
    for n in (n for n in BEST_OF_N if n <= mode.draws):
        picked = best_of_n_correct(rewards, correct, n).float()
        # Best-of-n is applied to the task's prompts only: elsewhere the model is the base (no forgetting).
        records.append({**common, "point": f"best-of-n-{n}", "heldout_accuracy": float(picked.mean()),
                        "heldout_kl_sampled_per_seq": best_of_n_kl(n), "per_problem": picked.tolist(),
                        "forgetting_kl_sampled_per_seq": 0.0, "capability_rate": lost.capability_rate})
    seconds = time.perf_counter() - start
    return [{**r, "seconds": seconds} for r in records]


def run_job(point: str, seed: int, mode: Mode, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One job in a worker process: its records, stamped with the code, machine and mode."""
    import torch

    torch.set_num_threads(max(args.threads, 1))
    stamp = _results.stamp()  # the code the run ran, not the code when it ended
    records = best_of_n_points(seed, mode, args) if point == "best-of-n" else trained_point(point, seed, mode, args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else stamp["machine"]
    extra = {"mode": mode.name, "reduced": mode.reduced, "model": mode.model, "eval_size": len(records[0]["per_problem"]),
             "device": device, "dtype": args.dtype, "overrides": list(args.set)}
    return [{**r, **stamp, **extra} for r in records]


def selected(only: str) -> list[str]:
    """The points named by ``--only``: comma-separated point names or prefixes (``constant``, ``budget-t``)."""
    chosen = []
    for word in only.split(","):  # a point's own name picks it alone (constant-0, not constant-0-land-t1)
        points = [word] if word in GRID else [p for p in GRID if p.startswith(word + "-") or
                                              (word.endswith("-") and p.startswith(word))]
        if not points:
            raise SystemExit(f"--only: {word!r} names no point; expected a point or a prefix of one of {list(GRID)}")
        chosen += [p for p in points if p not in chosen]
    return chosen


def seed_list(text: str) -> list[int]:
    """``"0,2,5-7"`` -> ``[0, 2, 5, 6, 7]``: seeds and inclusive ranges, in the order given."""
    seeds = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        if not (low.isdigit() and (high.isdigit() or not high)) or (high and int(high) < int(low)):
            raise ValueError(f"--seeds: expected seeds and ranges like 0,2,5-7, got {text!r} (part {part!r}); "
                             "give whole numbers, a range low-high with low <= high.")
        seeds += list(range(int(low), int(high or low) + 1))
    return seeds


def plan(args: argparse.Namespace, mode: Mode, root: Path | None) -> list[tuple[str, int]]:
    """The (point, seed) jobs still missing a record in this mode, seed-major: each call spreads over points."""
    done = {(r["point"], r["seed"]) for r in _results.read(RESULTS_NAME, root) if r.get("mode") == mode.name}
    todo = []
    for seed in seed_list(args.seeds or mode.seeds):
        for point in selected(args.only):
            if GRID[point] is None:
                continue
            recorded = ("best-of-n-1" if point == "best-of-n" else point, seed) in done
            if not recorded:
                todo.append((point, seed))
    return todo


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode = MODES["quick" if args.quick else "reduced" if args.reduced else "full"]
    root = Path(args.results) if args.results else None
    skipped = [p for p in selected(args.only) if GRID[p] is None]
    if skipped:
        print(f"not run (their config fields are not in TrainConfig yet): {', '.join(skipped)}", flush=True)
    todo, start, longest, failed = plan(args, mode, root), time.monotonic(), 0.0, 0
    print(f"{len(todo)} jobs to run in mode {mode.name} (seeds {args.seeds or mode.seeds})", flush=True)
    # A job that fails is named and left out.
    with job_pool(args.jobs) as pool:
        running: dict[Any, tuple[str, int, float]] = {}
        while todo or running:
            elapsed = time.monotonic() - start
            while todo and len(running) < args.jobs and (not args.budget_seconds or elapsed + longest < args.budget_seconds):
                point, seed = todo.pop(0)
                running[pool.submit(run_job, point, seed, mode, args)] = (point, seed, time.monotonic())
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                point, seed, began = running.pop(future)
                longest = max(longest, time.monotonic() - began)
                try:
                    records = future.result()
                except Exception as exc:  # noqa: BLE001 - one broken run must not lose the others' records
                    failed += 1
                    print(f"{point} seed {seed}: failed: {type(exc).__name__}: {exc}", flush=True)
                    continue
                for record in records:
                    _results.write(RESULTS_NAME, record, KEY, root)
                    print(_line(record), flush=True)
    print(f"{len(todo)} jobs left for a later call; {failed} failed; {time.monotonic() - start:.0f} s", flush=True)
    return 1 if failed else 0


def _line(r: dict[str, Any]) -> str:
    forgetting = "" if r.get("capability_rate") is None else (
        f", chat KL {r['forgetting_kl_sampled_per_seq']:.2f}, instructions {100 * r['capability_rate']:.0f} %")
    return (f"{r['point']} seed {r['seed']}: accuracy {100 * r['heldout_accuracy']:.1f} %, held-out KL "
            f"{r['heldout_kl_sampled_per_seq']:.2f}{forgetting}, {r['seconds']:.0f} s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(GRID), help="comma-separated points or prefixes (constant, budget-t2)")
    parser.add_argument("--seeds", default="", help="seeds and ranges, e.g. 0,2,8-31 (default: the mode's, 0-7 in full)")
    parser.add_argument("--reduced", action="store_true", help="the CPU version: 3 seeds, 150 problems, labelled")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 2 steps: a check that it works")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides on every point")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process")
    parser.add_argument("--budget-seconds", type=float, default=0,
                        help="start no run that the longest so far says would end after this many seconds (0: no limit)")
    parser.add_argument("--out", default="runs/frontier", help="the run directories (one per point and seed)")
    parser.add_argument("--results", default="", help="folder of frontier.jsonl (default: benchmarks/results)")
    args = parser.parse_args(argv)
    try:
        seed_list(args.seeds or "0")
    except ValueError as error:
        parser.error(str(error))
    return args


if __name__ == "__main__":
    raise SystemExit(main())
