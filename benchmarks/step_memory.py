"""Where the training step's memory goes on this CPU: each phase's peak resident set.

One step of a config (the default one, or a model and workload given here) after a warm-up step
(the optimizer's state exists from the first update on), split into the phases of the recipe
(``step_profile.py``'s stage wrapping): sampling, reference, loss forward (``token_terms``), loss
backward (the rest of ``accumulate_gradients``), optimizer (``optimize`` outside the loss pass:
clip and the step), the budget's start copy (``mark_step_start``), its readings
(``hold_kl_budget``) and the rest (rewards, advantages, logging). A phase's peak is the kernel's
high-water mark of the resident set (``VmHWM``, reset by writing ``5`` to
``/proc/self/clear_refs`` whenever a phase is entered or left, ``_common``'s mechanism): exact,
no sampling, every allocation that touched memory counts. Freed memory that malloc keeps counts
as resident, as it does for the process. ``resident_in`` is the resident set as the phase starts; the measured step's wall and CPU seconds
come with them (the machines are shared: CPU seconds are the steadier figure).
``--model llama-1b4`` is a random Llama of the 1B shape cut to 4 layers (``random_llama.py``).

    python benchmarks/step_memory.py --label after                       # the default step (LoRA)
    python benchmarks/step_memory.py --label after --lora-rank 0         # full fine-tuning
    python benchmarks/step_memory.py --label after --model llama-1b4 --dtype bfloat16 --prompts 4 --group 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import _current_rss, _peak_rss, _reset_peak, markdown_table  # noqa: E402

# recipe function -> phase; nested calls take over the inner part (token_terms inside accumulate_gradients)
WRAPPED = {"sample": "sampling", "add_reference": "reference", "token_terms": "loss_forward",
           "accumulate_gradients": "loss_backward", "optimize": "optimizer", "mark_step_start": "budget_start",
           "hold_kl_budget": "readings"}
PHASES = ("sampling", "reference", "loss_forward", "loss_backward", "optimizer", "budget_start", "readings", "other")
RANDOM = {"llama-1b4": "1b4", "llama-tiny": "tiny"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help=f"the config's model, or one of {sorted(RANDOM)}")
    p.add_argument("--lora-rank", type=int, default=None, help="0: full fine-tuning (default: the config's)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=None, help="prompts_per_step (default: the config's)")
    p.add_argument("--group", type=int, default=None, help="group_size (default: the config's)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="another TrainConfig field")
    p.add_argument("--label", default=None, help="write the row to results/step_memory.jsonl under this label")
    return p.parse_args(argv)


class PhasePeaks:
    """Wraps functions as phases; each phase keeps the largest peak of its intervals."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.peak: dict[str, int] = {}
        self.resident_in: dict[str, int] = {}
        self.source = "VmHWM" if _reset_peak() else "ru_maxrss"

    def _close(self) -> None:  # the interval that ends now belongs to the innermost open phase
        name = self.stack[-1] if self.stack else "other"
        self.peak[name] = max(self.peak.get(name, 0), _peak_rss(self.source == "VmHWM")[0])
        _reset_peak()

    def wrap(self, name: str, fn):
        def inner(*a, **k):
            self._close()
            self.resident_in.setdefault(name, _current_rss())
            self.stack.append(name)
            try:
                return fn(*a, **k)
            finally:
                self._close()
                self.stack.pop()
        return inner


def model_path(args: argparse.Namespace) -> str:
    if args.model not in RANDOM:
        return args.model
    import random_llama

    size = RANDOM[args.model]
    out = os.path.join(tempfile.gettempdir(), f"tether-random-llama-{size}-{args.dtype}")
    return str(random_llama.build_random_llama(size, out, tokenizer=random_llama.embedded_tokenizer(), dtype=args.dtype))


def config(args: argparse.Namespace):
    from tether.train.flags import parse_overrides
    from tether.train.config import TrainConfig

    given = {"lora_rank": args.lora_rank, "prompts_per_step": args.prompts, "group_size": args.group,
             "max_new_tokens": args.max_new_tokens}
    cfg = TrainConfig(model=model_path(args), threads=1, eval_size=0, dtype=args.dtype,
                      out=tempfile.mkdtemp(prefix="tether-step-memory-"), **{k: v for k, v in given.items() if v is not None})
    return cfg.override(parse_overrides(args.set)).validate()


def measure(args: argparse.Namespace) -> dict:
    """One warm-up step, then one step phase by phase; the row."""
    import torch

    from step_profile import staged
    from tether.train import recipe

    torch.set_num_threads(1)
    cfg = config(args)
    run = recipe.build_run(cfg)
    loaded = _current_rss()
    recipe.train_step(run, 0, recipe.sample)
    phases = PhasePeaks()
    originals = staged(recipe, lambda name, fn: phases.wrap(WRAPPED[name], fn), names=tuple(WRAPPED))
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        phases.wrap("step", lambda: recipe.train_step(run, 1, recipe.sample))()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        staged(recipe, lambda name, _: originals[name], names=tuple(WRAPPED))
    phases.peak["other"] = max(phases.peak.get("other", 0), phases.peak.pop("step", 0))
    params = list(run.models.policy.parameters())
    return {
        "model": args.model, "mode": "LoRA" if cfg.lora_rank else "full", "dtype": cfg.dtype,
        "prompts": cfg.prompts_per_step, "group": cfg.group_size, "max_new_tokens": cfg.max_new_tokens,
        "micro_batch_size": cfg.micro_batch_size, "settings": sorted(args.set), "threads": 1,
        "peak_source": phases.source, "step_s": wall, "step_cpu_s": cpu, "loaded_bytes": loaded, "step_peak_bytes": max(phases.peak.values()),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "trainable_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        "phases": {name: {"peak_bytes": phases.peak.get(name, 0), "resident_in_bytes": phases.resident_in.get(name, 0)}
                   for name in PHASES},
    }


def table(rows: list[dict]) -> str:
    """Peak resident MiB per phase, one row a (model, mode, settings, label); the largest phase in
    bold; the step's CPU seconds where the row has them."""
    lines = []
    for r in sorted(rows, key=lambda r: (r["model"], r["mode"], r["settings"], r["label"] != "before")):
        peaks = {n: r["phases"][n]["peak_bytes"] for n in PHASES}
        top = max(peaks, key=peaks.get)
        cells = [f"**{peaks[n] / 2**20:,.0f}**" if n == top else f"{peaks[n] / 2**20:,.0f}" for n in PHASES]
        code = f"{r['label']} ({r['commit']}{', ' + ' '.join(r['settings']) if r['settings'] else ''})"
        cpu = f"{r['step_cpu_s']:.0f}" if "step_cpu_s" in r else ""
        lines.append([r["model"], r["mode"], r["dtype"], f"{r['prompts']}×{r['group']}×{r['max_new_tokens']}", code,
                      f"{r['loaded_bytes'] / 2**20:,.0f}", *cells, cpu])
    return markdown_table(["model", "mode", "dtype", "step", "code", "loaded", *PHASES, "step CPU s"], lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    row = measure(args)
    if args.label:
        import _results

        row = {**row, "label": args.label, **_results.stamp()}
        _results.write("step_memory", row, key=("model", "mode", "dtype", "settings", "label"))
    print(f"{args.model} {row['mode']} {row['dtype']}, {row['prompts']}x{row['group']}x{row['max_new_tokens']} tokens, "
          f"1 thread: peak resident MiB by phase ({row['peak_source']})\n")
    print(table([{"label": "-", "commit": "-", **row}]))
    return row


if __name__ == "__main__":
    main()
