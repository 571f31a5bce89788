"""Why a step's KL leaves the band after the budget landed its weights in it: new prompts, new
draws, or a reading taken on answers the kept weights did not give.

The budget reads the weights it keeps on the step's own answers, sampled by the weights the step
started from. The leash benchmark scores the next step on the answers the kept weights give to
new prompts. This script trains one leash-grid run and, before each step samples, reads the
weights it is about to sample with (the previous step's kept weights) four ways, each the mean
exact KL per answer:

- ``kept``: on the previous step's answers (what the budget read when it kept them);
- ``kept_is``: the same answers, each weighted by its sequence importance ratio kept / sampler,
  self-normalised (an estimate of the on-policy KL on those prompts);
- ``own_same``: fresh answers of the kept weights to the previous step's prompts;
- ``own_new``: the answers the step then samples to its own prompts (its ``kl_exact_per_seq``).

``kept -> own_same`` is the off-policy reading; ``own_same -> own_new`` is new prompts and draws.
Each run's rows go to ``benchmarks/results/leash_reading.jsonl``.

    python benchmarks/leash_reading.py --settings 4,6 --seeds 0 --threads 1
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import replace
from pathlib import Path

import torch

import _results
from leash import Setting, settings
from tether.models.records import StepRecord
from tether.ops import effective_sample_size
from tether.train.config import TrainConfig
from tether.train.recipe import add_reference, sample, step_problems, train
from tether.train.run import Run
from tether.train.updates import answer_kl


def importance_weighted(kl: torch.Tensor, log_ratio: torch.Tensor) -> float:
    """Self-normalised importance-weighted mean of ``kl [B]`` with sequence log-ratios ``[B]``."""
    weights = torch.softmax(log_ratio.double(), 0)
    return float((weights * kl.double()).sum())


class Probe:
    """A rollout that reads the weights it samples with before the step goes on."""

    def __init__(self) -> None:
        self.previous: tuple[StepRecord, list] | None = None
        self.rows: list[dict[str, float]] = []

    @torch.no_grad()
    def __call__(self, run: Run, problems: list, step: int) -> StepRecord:
        row: dict[str, float] = {"step": step + 1}
        if self.previous is not None:
            record, prev_problems = self.previous
            record = replace(record, ref_log_probs=None, ref_hidden=None)  # the step may have let its states go
            add_reference(run, record)
            mask = record.assistant_mask
            kl = answer_kl(run.actor, record)
            logp = run.actor.score(record.tokens, record.attention_mask, where=mask).log_probs
            log_ratio = ((logp.double() - record.sample_log_probs.to(logp.device).double()) * mask.to(logp.device)).sum(-1)
            fresh = sample(run, prev_problems, step)
            add_reference(run, fresh)
            row |= {"kept": float(kl.mean()), "kept_is": importance_weighted(kl, log_ratio.cpu()),
                    "own_same": float(answer_kl(run.actor, fresh).mean()),
                    "is_ess": float(effective_sample_size(log_ratio.double()))}
        record = sample(run, problems, step)
        add_reference(run, record)
        row["own_new"] = float(answer_kl(run.actor, record).mean())
        self.rows.append(row)
        self.previous = (record, problems)
        return record


def run_one(setting: Setting, seed: int, args: argparse.Namespace) -> dict:
    out = Path(args.out) / f"{setting.kl_mode}-lr{setting.learning_rate:g}-b{setting.kl_coef:g}-s{seed}"
    cfg = TrainConfig(
        steps=args.steps, prompts_per_step=6, group_size=4, seed=seed, max_new_tokens=16, micro_batch_size=24,
        learning_rate=setting.learning_rate, kl_coef=setting.kl_coef, kl_mode=setting.kl_mode,
        kl_estimator="k3" if setting.kl_mode == "loss" else "k1", kl_controller="budget", kl_push=False,
        kl_target=1.0, kl_signal="exact", kl_bound=3.0, eval_size=0, checkpoint_every=0, out=str(out),
        threads=args.threads, overwrite=True)
    stamp, probe = _results.stamp(), Probe()
    train(cfg, progress=False, rollout=probe)
    return {**stamp, "setting": setting.name, "seed": seed, "kl_target": 1.0, "steps": probe.rows}


def spreads(record: dict) -> dict[str, float]:
    """The sd over steps 5 on of each log ratio: the miss (own_new / kept), the off-policy reading
    (own_same / kept), new prompts and draws (own_new / own_same), the importance-weighted reading's
    error (own_same / kept_is)."""
    rows = [r for r in record["steps"] if "kept" in r and r["step"] > 4]
    pairs = {"miss": ("kept", "own_new"), "off_policy": ("kept", "own_same"), "new_prompts": ("own_same", "own_new"),
             "importance_weighted": ("kept_is", "own_same")}
    if len(rows) < 2:
        return {k: math.nan for k in pairs}
    return {k: statistics.stdev(math.log(r[b] / r[a]) for r in rows) for k, (a, b) in pairs.items()}


def summarise(record: dict) -> str:
    sd = spreads(record)
    return (f"| {record['setting']} | {record['seed']} | {sd['miss']:.2f} | {sd['off_policy']:.2f} "
            f"| {sd['new_prompts']:.2f} | {sd['importance_weighted']:.2f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="4,6", help="1-based indices into leash.py's settings")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/leash_reading")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    grid = settings(quick=False)
    print("| setting | seed | sd log own_new / kept (the benchmark's miss) | off-policy: own_same / kept "
          "| new prompts: own_new / own_same | importance-weighted: own_same / kept_is |")
    print("|---|---|---|---|---|---|")
    for index in map(int, args.settings.split(",")):
        for seed in map(int, args.seeds.split(",")):
            record = run_one(grid[index - 1], seed, args)
            _results.write("leash_reading", record, key=("setting", "seed"))
            print(summarise(record), flush=True)


if __name__ == "__main__":
    main()
