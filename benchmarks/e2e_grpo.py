"""One GRPO optimizer step end to end: ``tether train``'s step against TRL's ``GRPOTrainer``.

What is timed: a whole optimizer step of GRPO with a KL leash on the embedded
SmolLM2-135M-Instruct (float32, CPU) and the default ``arithmetic`` task: sample
``group`` answers for each of ``prompts`` problems, reward them, score the reference,
compute group advantages, run the loss forward and backward micro-batch by micro-batch,
clip the gradient norm and step AdamW. tether runs ``tether.train.recipe.train_step`` on a
``build_run(TrainConfig(...))``; TRL runs ``GRPOTrainer.train()`` and only the span from
its ``on_step_begin`` to its ``on_step_end`` callback counts (the trainer runs in a worker
thread that the timed call releases one step at a time, so ``_common``'s fresh-process
timing and memory code serves both). One untimed warm-up step, then the median of K steps.

The same for both: the problems (tether's task stream for ``seed`` 0 with its held-out set
removed, the same order; TRL reads them unshuffled from an in-memory ``datasets.Dataset``
of chats), group size, completion limit, temperature 1, learning rate, KL coefficient
(``beta``, constant) with a k3 estimator times the importance ratio, clip epsilon 0.2, token-mean
loss over the whole step (TRL's ``dapo``), z-scored group advantages, no entropy bonus,
gradient-norm clip 1.0, AdamW without weight decay at a constant rate, one optimizer step
per generation round (``per_device_train_batch_size`` x ``gradient_accumulation_steps`` =
prompts x group, micro-batches of tether's ``micro_batch_size`` or the largest divisor of
the batch below it), no old-policy forward pass (one update per round), float32, no
gradient checkpointing, the same torch thread count, the same reward function. Rows:
LoRA with tether's defaults (rank 16, alpha 32, all projections; TRL gets the same
``peft.LoraConfig`` and, like tether, uses the adapter-disabled model as the reference) and
full fine-tuning (tether's ``frozen_copy`` reference; TRL loads a second copy of the
weights from the model's local directory).

Where the two still differ (cannot be removed without changing either library):

- Sampling: tether's own KV-cache decode loop records each token's log-prob as it samples
  and drops finished rows; TRL calls ``model.generate`` and the loss recomputes log-probs.
- Completion lengths: by default both are forced to exactly ``max_new_tokens`` tokens so
  that both process the same token count. TRL gets ``min_new_tokens`` (end-of-turn is
  masked out of the sampling distribution); tether has no such option, so its sampler is
  given an end-of-sequence id set that no token matches (``sampler.eos_ids = {-1}``): it
  may sample ``<|im_end|>`` and carry on. ``--natural-lengths`` lets both stop at
  end-of-turn; the mean completion length per tool is printed either way.
- Scoring: tether runs each distinct prompt through the decoder once per micro-batch and the
  answers on top of its cache (``tether.models.packing``), padding-free, with its
  chunked output head at each distinct prompt's positions and every answer token; TRL runs
  every padded row in full and its fused head only at completion positions. Both compute
  per-token entropy in the loss (logged, coefficient 0; tether keeps it out of the graph).
  Both process the same token count by the definition below: the saving is tether's.
- Optimizer: tether's ``torch.optim.AdamW`` defaults; TRL's ``optim="adamw_torch"``.
- Mode: tether keeps the model in eval mode, TRL in train mode with dropout disabled
  (SmolLM2 has no dropout, so the arithmetic is the same).
- KL gradient: tether's k3 term with importance correction and TRL's bias-corrected k3 are
  the same value; their autograd graphs differ slightly.

Reported per row: median step time (wall; CPU seconds of all threads beside it), tokens
per step and tokens/s (defined below), mean completion length, peak resident set of the
process during the timed steps (``VmHWM`` after a reset at the end of the warm-up) and over
its whole life (``ru_maxrss``, including model loading), and the tether/TRL ratios with the
targets: tether tokens/s >= 1.2x TRL's and peak memory <= 0.7x TRL's. A second table splits
each step into phases (sampling; rewards + reference log-probs + advantages; loss forward
and backward; gradient clip + optimizer step + the rest).

Default size: 4 prompts x 4 answers x 16 new tokens, not ``TrainConfig``'s 12 x 6 x 20. At
the training defaults one tether LoRA step alone took 99 s on the 2-core box (1 thread,
CPU shared), so the four variants x (warm-up + 3 steps) would take about half an hour;
``--prompts 12 --group 6 --max-new-tokens 20`` measures them anyway.

Threads: every variant sets the same torch thread count (``--threads``, default 2). On a
CPU that other jobs share, two OpenMP threads wait on each other at every barrier and a
step can take 10-20x longer from one run to the next; ``--threads 1`` is the stable
choice there (as in ``scoring.py``).

Records: a full run writes one row a tool and mode to ``benchmarks/results/e2e_grpo.jsonl``
(``--results DIR`` elsewhere; a ``--quick`` run only where ``--results`` is given): ``record``'s
keys, ``run`` shared by the invocation's rows. ``e2e_tables.py`` builds docs/performance.md's
tables from the newest full run (``python benchmarks/tables.py``).

    .venv-bench/bin/python benchmarks/e2e_grpo.py              # both tools, both modes (~10 min)
    .venv-bench/bin/python benchmarks/e2e_grpo.py --quick      # 2 x 2 x 4 tokens, 1 timed step
    .venv-bench/bin/python benchmarks/e2e_grpo.py --no-trl     # tether rows only
    .venv/bin/python benchmarks/e2e_grpo.py                    # tether only (no TRL there)
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import importlib.util
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback

# Everything is local: the embedded model is a directory on disk and nothing is downloaded.
for _flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_flag, "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _results  # noqa: E402
from _common import cap_memory, child_error, markdown_table, measure_in_subprocess, met, mib, verdict  # noqa: E402

FULL = {"prompts": 4, "group": 4, "max_new_tokens": 16}
QUICK = {"prompts": 2, "group": 2, "max_new_tokens": 4}
TOKENS_TARGET = 1.2  # tether tokens/s >= this x TRL's
MEMORY_TARGET = 0.7  # tether peak RSS (timed steps) <= this x TRL's
MODES = {"LoRA": True, "full": False}
TOOLS = {"tether": "tether", "TRL": "trl"}  # as printed -> as recorded (gpu_grpo.jsonl's spelling, SPEC section 13)
DISPLAY = {"tether": "tether", "trl": "TRL", "lora": "LoRA", "full": "full"}  # as recorded -> as printed
NAME = "e2e_grpo"  # benchmarks/results/e2e_grpo.jsonl
ROW_KEY = ("run", "tool", "mode")  # a row replaces the one equal on these
PHASES = ("sampling", "scoring", "loss", "optimizer")
PHASE_TITLES = {
    "sampling": "sampling",
    "scoring": "rewards + reference + advantages",
    "loss": "loss forward + backward",
    "optimizer": "clip + optimizer step + rest",
}
TOKENS_DEFINITION = (
    "tokens/s = non-pad prompt + completion tokens of the step's prompts x group sequences, "
    "divided by the step's wall time"
)


# ------------------------------------------------------------------ shared workload
def train_config(work: dict, out: str = "runs/bench-e2e"):
    """tether's ``TrainConfig`` for the workload (everything else at its defaults)."""
    from tether.train.config import TrainConfig

    base = TrainConfig()
    values = {
        "prompts_per_step": work["prompts"],
        "group_size": work["group"],
        "max_new_tokens": work["max_new_tokens"],
        "micro_batch_size": micro_batch(work["prompts"] * work["group"], base.micro_batch_size),
        "threads": work["threads"],
        "steps": work["steps"],
        "out": out,
        # TRL's beta is constant: the default budget leash's readings of the updated weights
        # (tether's own work, measured in docs/leash.md) would be timed against nothing.
        "kl_controller": "constant",
    }
    if not work["lora"]:
        values["lora_rank"] = 0
    if work.get("tether_gradient_checkpointing"):  # benchmarks/gpu_grpo.py --gradient-checkpointing: both tools
        values["gradient_checkpointing"] = True
    if "device" in work:  # benchmarks/gpu_grpo.py: the same workload on a GPU
        values.update(device=work["device"], dtype=work["dtype"])
    if work.get("model"):  # benchmarks/gpu_grpo.py --model: a model directory instead of the embedded one
        values["model"] = work["model"]
    return base.override(values).validate()


def micro_batch(batch: int, limit: int) -> int:
    """The largest divisor of ``batch`` not above ``limit``: TRL needs whole micro-batches."""
    return max(d for d in range(1, min(batch, limit) + 1) if batch % d == 0)


def step_problems(cfg, n_steps: int) -> list:
    """The problems of steps ``0 .. n_steps - 1``, as ``tether.train.recipe.rollout`` draws them."""
    from tether.train.tasks import load_task

    task = load_task(cfg.task)
    excluded = {p.key for p in task.eval_set(cfg.eval_size)}
    return [task.train_problem(cfg.seed, i, excluded) for i in range(n_steps * cfg.prompts_per_step)]


class PhaseClock:
    """Wall seconds per phase within one step; ``wrap`` times every call of a function (a phase
    called inside another counts in both). On a GPU it also keeps each phase's peak allocated
    memory (``gpu_peaks``), to say where a step's peak falls: torch's peak is reset whenever a
    phase is entered or left, and each interval's peak goes to the innermost phase open in it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.gpu_peaks: dict[str, int] = {}
        self.high = 0  # the step's peak so far, kept across the phases' resets of torch's peak
        self.last: dict[str, object] = {}
        self.open: list[str] = []

    def reset(self) -> None:
        self.seconds, self.gpu_peaks, self.high, self.last, self.open = {}, {}, 0, {}, []

    def _interval(self) -> None:
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        peak = torch.cuda.max_memory_allocated()
        self.high = max(self.high, peak)
        if self.open:
            self.gpu_peaks[self.open[-1]] = max(self.gpu_peaks.get(self.open[-1], 0), peak)
        torch.cuda.reset_peak_memory_stats()

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self._interval()  # what came before belongs to the phase that was open
            self.open.append(name)
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self._interval()
                self.open.pop()
            self.last[name] = result
            return result

        return timed


def _memory(clock: PhaseClock | None = None) -> dict:
    """Peak resident set since the last reset (``VmHWM``) and over the process life; on a GPU the
    step's peak allocated memory (with what ``clock``'s phases saw) and each phase's peak."""
    import resource

    hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    out = {"hwm": hwm, "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    import torch

    if torch.cuda.is_initialized():  # the step's peak GPU memory, then a fresh peak for the next step
        torch.cuda.synchronize()
        out["gpu_peak"] = max(torch.cuda.max_memory_allocated(), clock.high if clock else 0)
        if clock is not None:
            out["gpu_peak_by_phase"] = dict(clock.gpu_peaks)
        torch.cuda.reset_peak_memory_stats()
    return out


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


# ------------------------------------------------------------------ tether
def setup_tether(work: dict, info_path: str):
    """One ``train_step`` per call on ``build_run(train_config(work))``."""
    import torch

    from tether.train import recipe

    folder = tempfile.TemporaryDirectory()
    cap_memory(work.get("memory_cap_mib"), work.get("device", "cpu"))  # largest_model.py's smaller card
    run = recipe.build_run(train_config(work, out=folder.name))
    if not work["natural_lengths"]:
        run.sampler.eos_ids = {-1}  # no token id matches: every answer runs to max_new_tokens
    clock = PhaseClock()
    # train_step looks the stages up in the module at call time (the rollout is its argument),
    # so wrapping them times each phase.
    sample = clock.wrap("sampling", recipe.sample)
    recipe.add_rewards = clock.wrap("rewards", recipe.add_rewards)
    recipe.add_reference = clock.wrap("reference", recipe.add_reference)
    recipe.accumulate_gradients = clock.wrap("loss", recipe.accumulate_gradients)
    # inside "loss" (forward; the rest of it is backward) and after it: where the peak falls
    recipe.token_terms = clock.wrap("loss_forward", recipe.token_terms)
    recipe.optimize = clock.wrap("optimizer", recipe.optimize)
    recipe.mark_step_start = clock.wrap("budget_start", recipe.mark_step_start)
    recipe.hold_kl_budget = clock.wrap("readings", recipe.hold_kl_budget)
    counter = itertools.count()

    def step() -> None:
        clock.reset()
        start = time.perf_counter()
        recipe.train_step(run, next(counter), sample)
        if run.models.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        record = clock.last["sampling"]
        seconds = clock.seconds
        phases = {
            "sampling": seconds["sampling"],
            "scoring": seconds["rewards"] + seconds["reference"],
            "loss": seconds["loss"],
        }
        phases["optimizer"] = wall - sum(phases.values())
        detail = {name: seconds.get(name, 0.0) for name in ("loss_forward", "budget_start", "readings")}
        detail["loss_backward"] = seconds["loss"] - detail["loss_forward"]
        detail["optimizer_step"] = seconds["optimizer"] - seconds["loss"]  # clip and the step
        completion = record.assistant_mask.sum(-1).float()
        _append(info_path, {
            "tokens": int(record.attention_mask.sum()),
            "mean_completion": float(completion.mean()),
            "phases": phases,
            "phase_detail": detail,
            "threads": torch.get_num_threads(),
            **_memory(clock),
        })

    step.keep_alive = folder  # the run directory lives as long as the callable
    return step


# ------------------------------------------------------------------ TRL
class _StopTraining(Exception):
    """Raised in the trainer thread to end ``train()`` at interpreter exit."""


def _trl_args(cfg, work: dict, output_dir: str):
    from trl import GRPOConfig

    batch = cfg.prompts_per_step * cfg.group_size
    generation = None if work["natural_lengths"] else {"min_new_tokens": cfg.max_new_tokens}
    # later transformers 5.x renamed TrainingArguments.gradient_checkpointing; the GPU image has 5.17
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return GRPOConfig(
        output_dir=output_dir, use_cpu=work.get("device", "cpu") == "cpu", bf16=work.get("dtype") == "bfloat16",
        fp16=False, seed=cfg.seed, max_steps=work["steps"],
        # no logging, saving, evaluation or progress bars
        report_to="none", logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0, shuffle_dataset=False,
        # tether's optimizer settings
        learning_rate=cfg.learning_rate, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        weight_decay=cfg.weight_decay, max_grad_norm=cfg.grad_clip,
        # one generation round of prompts x group per optimizer step, in tether's micro-batches
        per_device_train_batch_size=cfg.micro_batch_size, gradient_accumulation_steps=batch // cfg.micro_batch_size,
        num_generations=cfg.group_size, num_iterations=1, use_vllm=False,
        max_completion_length=cfg.max_new_tokens, generation_kwargs=generation, temperature=cfg.temperature,
        # the loss: clipped ratio, k3 KL with the importance ratio, token mean over the step
        beta=cfg.kl_coef, epsilon=cfg.clip_epsilon, loss_type="dapo", scale_rewards="group",
        disable_dropout=True, **{checkpointing: work["trl_gradient_checkpointing"]},
    )


def _trl_reward(cfg, problems: list):
    """The task's reward as a TRL reward function; rows carry their problem's index."""
    from tether.train.tasks import load_task

    task = load_task(cfg.task)

    def arithmetic_reward(completions, index, **_):
        return [task.reward(c[-1]["content"], problems[i]) for c, i in zip(completions, index)]

    return arithmetic_reward


def _trl_lora(cfg):
    """The ``peft.LoraConfig`` tether's ``build_models`` uses for the same config."""
    from peft import LoraConfig

    targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=targets)


def _trl_trainer_class(clock: PhaseClock, counts: dict):
    """``GRPOTrainer`` with its own methods timed and the step's tokens counted."""
    from trl import GRPOTrainer

    class Trainer(GRPOTrainer):
        def _generate(self, prompts):
            start = time.perf_counter()
            out = super()._generate(prompts)
            clock.seconds["sampling"] = clock.seconds.get("sampling", 0.0) + time.perf_counter() - start
            prompt_ids, completion_ids = out[0], out[1]
            lengths = [len(c) for c in completion_ids]
            counts.update(tokens=sum(map(len, prompt_ids)) + sum(lengths), mean_completion=sum(lengths) / len(lengths))
            return out

    Trainer._generate_and_score_completions = clock.wrap("generate_and_score", Trainer._generate_and_score_completions)
    Trainer.training_step = clock.wrap("training_step", Trainer.training_step)
    return Trainer


def _trl_gate(clock: PhaseClock):
    """A callback that holds the trainer at each step's start until the timed call lets it go."""
    import torch
    from transformers import TrainerCallback

    class Gate(TrainerCallback):
        def __init__(self) -> None:
            self.go, self.done = threading.Semaphore(0), threading.Semaphore(0)
            self.started, self.wall, self.threads, self.stop = 0.0, 0.0, 0, False
            self.failure: BaseException | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            self.go.acquire()
            if self.stop:
                raise _StopTraining
            clock.reset()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.wall = time.perf_counter() - self.started
            self.threads = torch.get_num_threads()  # as seen by the thread that trains
            self.done.release()

    return Gate()


def _train_in_thread(trainer, gate, threads: int) -> None:
    """Start ``trainer.train()`` in a daemon thread; at exit, stop it and wait for it."""
    import torch

    def train() -> None:
        torch.set_num_threads(threads)
        try:
            trainer.train()
        except _StopTraining:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the timed call, which re-raises
            gate.failure = exc
            traceback.print_exc()
            gate.done.release()

    worker = threading.Thread(target=train, daemon=True)
    worker.start()

    def finish() -> None:
        # A thread still inside torch when the interpreter exits aborts the process: let the
        # trainer finish its last step's bookkeeping, or stop it where it waits.
        gate.stop = True
        gate.go.release()
        worker.join(timeout=600)

    atexit.register(finish)


def setup_trl(work: dict, info_path: str):
    """``GRPOTrainer.train()`` in a worker thread; each call lets exactly one step run."""
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback

    from tether.models import load_default_model

    torch.set_num_threads(work["threads"])
    cfg = train_config(work)
    problems = step_problems(cfg, work["steps"])
    dataset = Dataset.from_list([{"prompt": p.chat, "index": i} for i, p in enumerate(problems)])
    clock, counts = PhaseClock(), {}
    gate = _trl_gate(clock)
    output_dir = tempfile.TemporaryDirectory()
    device, dtype = work.get("device", "cpu"), getattr(torch, work.get("dtype", "float32"))
    cap_memory(work.get("memory_cap_mib"), device)
    if work.get("model"):  # a model directory (benchmarks/gpu_grpo.py --model)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(work["model"], dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(work["model"], local_files_only=True)
    else:
        model, tokenizer = load_default_model(dtype=dtype)
    model.to(device)
    trainer = _trl_trainer_class(clock, counts)(
        model=model, reward_funcs=_trl_reward(cfg, problems), args=_trl_args(cfg, work, output_dir.name),
        train_dataset=dataset, processing_class=tokenizer, callbacks=[gate],
        peft_config=_trl_lora(cfg) if work["lora"] else None,
    )
    # The end-of-training summary would be printed from the worker thread into the line on which
    # the benchmark child reports its result.
    trainer.remove_callback(PrinterCallback)
    _train_in_thread(trainer, gate, work["threads"])

    def step() -> None:
        gate.go.release()
        gate.done.acquire()
        if device == "cuda":
            torch.cuda.synchronize()
        if gate.failure is not None:
            exc = gate.failure
            raise RuntimeError(f"TRL training failed: {type(exc).__name__}: {exc}") from exc
        seconds = clock.seconds
        phases = {
            "sampling": seconds["sampling"],
            "scoring": seconds["generate_and_score"] - seconds["sampling"],
            "loss": seconds["training_step"] - seconds["generate_and_score"],
        }
        phases["optimizer"] = gate.wall - sum(phases.values())
        _append(info_path, {**counts, "phases": phases, "threads": gate.threads, **_memory(clock)})

    step.keep_alive = output_dir  # the trainer's output directory lives as long as the callable
    return step


# ------------------------------------------------------------------ driver
def trl_problem() -> str | None:
    """Why TRL cannot run in this environment, or None."""
    missing = [name for name in ("trl", "datasets", "peft") if importlib.util.find_spec(name) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (run with .venv-bench/bin/python)"
    return None


def measure(tool: str, work: dict, args) -> dict:
    """One (tool, mode) in a fresh process: timing from ``_common`` plus the logged step records."""
    setup = {"tether": "setup_tether", "TRL": "setup_trl"}[tool]
    with tempfile.TemporaryDirectory() as folder:
        info_path = os.path.join(folder, "steps.jsonl")
        try:
            m = measure_in_subprocess(__file__, setup, {"work": work, "info_path": info_path},
                                      repeats=args.steps, warmup=args.warmup, timeout_s=args.timeout)
        except Exception as exc:  # noqa: BLE001 - reported in the table instead of aborting the run
            return {"error": child_error(exc), "detail": str(exc)}
        with open(info_path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    timed = records[args.warmup:]
    return {"m": m, "records": timed}


def summarise(result: dict) -> dict:
    m, records = result["m"], result["records"]
    tokens = statistics.median(r["tokens"] for r in records)
    return {
        "wall": m.median_s,
        "times": m.times_s,
        "cpu": m.cpu_median_s,
        "tokens": tokens,
        "tokens_per_s": tokens / m.median_s,
        "completion": statistics.mean(r["mean_completion"] for r in records),
        "peak": records[-1]["hwm"],
        "lifetime": records[-1]["ru_maxrss"],
        "phases": {p: statistics.median(r["phases"][p] for r in records) for p in PHASES},
        # tether's split of its phases (loss forward / backward, the leash's readings); TRL has none
        "detail": {name: statistics.median(r["phase_detail"][name] for r in records)
                   for name in (records[0].get("phase_detail") or {})},
        "threads": sorted({r["threads"] for r in records}),
    }


def label(row: dict) -> str:
    """A row's mode as the tables print it, with what its run changed from the default workload."""
    extra = [name for key, name in (("natural_lengths", "natural lengths"),
                                    ("trl_gradient_checkpointing", "TRL checkpointing")) if row.get(key)]
    return DISPLAY[row["mode"]] + (f" ({', '.join(extra)})" if extra else "")


def settings(args: argparse.Namespace, work: dict, micro_batch_size: int) -> dict:
    """The workload and library versions every row of one invocation records."""
    import torch

    return {"model": "default", "device": "CPU", "dtype": "float32", "prompts": work["prompts"], "group": work["group"],
            "max_new_tokens": work["max_new_tokens"], "micro_batch_size": micro_batch_size, "threads": work["threads"],
            "natural_lengths": work["natural_lengths"], "trl_gradient_checkpointing": work["trl_gradient_checkpointing"],
            "steps": args.steps, "warmup": args.warmup, "quick": args.quick, "torch": torch.__version__,
            **_results.versions("trl", "transformers", "peft")}


def record(run: str, tool: str, mode: str, setup: dict, result: dict) -> dict:
    """One row of ``e2e_grpo.jsonl``: ``summarise``'s figures of one (tool, mode), raw, with the
    run's ``setup`` (``settings``) and the machine's stamp; a failed variant keeps its ``error``."""
    row = {"run": run, "tool": TOOLS[tool], "mode": mode.lower(), **setup}
    if "error" in result:
        return {**row, "error": result["error"], **_results.stamp()}
    s = summarise(result)
    return {**row, "median_step_s": s["wall"], "step_times_s": list(s["times"]), "cpu_s": s["cpu"],
            "tokens_per_step": s["tokens"], "tokens_per_s": s["tokens_per_s"], "mean_completion_tokens": s["completion"],
            "peak_rss_bytes": s["peak"], "lifetime_rss_bytes": s["lifetime"], "phases_s": s["phases"],
            "phase_detail_s": s["detail"],
            # VmHWM: the timed steps' peak; ru_maxrss where the kernel's counter could not be reset (process life)
            "peak_rss_source": result["m"].peak_source, "threads_seen": s["threads"], **_results.stamp()}


def ratios(ours: dict | None, theirs: dict | None) -> tuple[float, float] | None:
    """tether / TRL tokens/s and peak RSS (timed steps) of two rows of one run; None unless both ran."""
    if not ours or not theirs or "error" in ours or "error" in theirs:
        return None
    return ours["tokens_per_s"] / theirs["tokens_per_s"], ours["peak_rss_bytes"] / theirs["peak_rss_bytes"]


def main_table(rows: list[dict]) -> str:
    """One line a row (``record``'s), the tether line with its ratios to TRL's row of the same mode."""
    by = {(r["tool"], r["mode"]): r for r in rows}
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([label(r), DISPLAY[r["tool"]], f"failed: {r['error']}"] + [""] * 9)
            continue
        line = [label(r), DISPLAY[r["tool"]], f"{r['median_step_s']:.2f}", " ".join(f"{t:.2f}" for t in r["step_times_s"]),
                f"{r['cpu_s']:.2f}", f"{r['tokens_per_step']:.0f}", f"{r['mean_completion_tokens']:.1f}",
                f"{r['tokens_per_s']:.1f}", mib(r["peak_rss_bytes"]), mib(r["lifetime_rss_bytes"])]
        both = ratios(r, by.get(("trl", r["mode"]))) if r["tool"] == "tether" else None
        line += ([f"{both[0]:.2f}x {verdict(both[0], TOKENS_TARGET, True)}",
                  f"{both[1]:.2f}x {verdict(both[1], MEMORY_TARGET, False)}"] if both else ["", ""])
        lines.append(line)
    headers = ["mode", "tool", "median step (s)", "step times (s)", "median CPU (s)", "tokens/step",
               "mean completion (tokens)", "tokens/s", "peak RSS, timed steps (MiB)", "peak RSS, process life (MiB)",
               "tokens/s tether/TRL", "peak RSS tether/TRL"]
    return markdown_table(headers, lines)


def phase_table(rows: list[dict]) -> str:
    """Median seconds a step per phase and its share of the step, one line a row that ran; and of
    the last phase, what tether's leash spent reading the kept weights (``kl_bound``; TRL has none)."""
    lines = []
    for r in rows:
        if "error" in r:
            continue
        total = sum(r["phases_s"].values())
        readings = r.get("phase_detail_s", {}).get("readings")
        lines.append([label(r), DISPLAY[r["tool"]]]
                     + [f"{r['phases_s'][p]:.2f} ({100 * r['phases_s'][p] / total:.0f}%)" for p in PHASES]
                     + ["" if readings is None else f"{readings:.2f}"])
    return markdown_table(["mode", "tool"] + [f"{PHASE_TITLES[p]} (s)" for p in PHASES]
                          + ["of which the leash's reading of the kept weights (s)"], lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 prompts x 2 answers x 4 tokens, 1 timed step")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps per variant (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps per variant")
    parser.add_argument("--prompts", type=int, default=None, help=f"prompts per step (default {FULL['prompts']})")
    parser.add_argument("--group", type=int, default=None, help=f"answers per prompt (default {FULL['group']})")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"completion limit (default {FULL['max_new_tokens']})")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every variant")
    parser.add_argument("--no-trl", action="store_true", help="tether rows only")
    parser.add_argument("--natural-lengths", action="store_true",
                        help="let answers end at end-of-turn instead of forcing max-new-tokens tokens")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="TRL with gradient checkpointing (its GRPOConfig default; tether has none)")
    parser.add_argument("--modes", default="LoRA,full", help="comma-separated subset of LoRA,full")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before a variant's process is killed")
    parser.add_argument("--results", default=None, metavar="DIR",
                        help=f"write one row a tool and mode to DIR/{NAME}.jsonl (default: benchmarks/results; "
                             "a --quick run records only where DIR is given)")
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (1 if args.quick else 3)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or args.steps < 1 or args.warmup < 0:
        parser.error(f"--modes takes a subset of {sorted(MODES)} (got {unknown}); --steps >= 1; --warmup >= 0")
    return args


def results_dir(args: argparse.Namespace):
    """Where the rows go (``_results.destination``: a quick run without ``--results`` records nothing)."""
    return _results.destination(args.results, args.quick)


def main(argv=None) -> list[dict]:
    import torch

    args = parse_args(argv)
    size = QUICK if args.quick else FULL
    work = {
        "prompts": args.prompts or size["prompts"],
        "group": args.group or size["group"],
        "max_new_tokens": args.max_new_tokens or size["max_new_tokens"],
        "threads": args.threads,
        "steps": args.warmup + args.steps,
        "natural_lengths": args.natural_lengths,
        "trl_gradient_checkpointing": args.trl_gradient_checkpointing,
    }
    cfg = train_config({**work, "lora": True})
    results = results_dir(args)
    print(
        f"GRPO optimizer step end to end, SmolLM2-135M-Instruct float32 on CPU, task {cfg.task}: "
        f"{work['prompts']} prompts x {work['group']} answers, max {work['max_new_tokens']} new tokens "
        f"({'natural lengths' if work['natural_lengths'] else 'lengths forced to the limit'}), micro-batch "
        f"{cfg.micro_batch_size}, lr {cfg.learning_rate}, beta {cfg.kl_coef}, temperature {cfg.temperature}; "
        f"torch {torch.__version__}, {args.threads} thread(s); median of {args.steps} steps after {args.warmup} warm-up\n"
    )
    started = time.perf_counter()
    run = _results.run_id()
    setup = settings(args, work, cfg.micro_batch_size)
    why_not = None if args.no_trl else trl_problem()
    rows, failures = [], []
    for mode in args.modes:
        for tool in ["tether"] + ([] if args.no_trl else ["TRL"]):
            result = ({"error": why_not, "detail": ""} if tool == "TRL" and why_not else
                      measure(tool, {**work, "lora": MODES[mode]}, args))
            rows.append(record(run, tool, mode, setup, result))
            if results is not None:  # after each variant: a later failure keeps the rows before it
                _results.write(NAME, rows[-1], key=ROW_KEY, root=results)
            if result.get("detail"):
                failures.append(f"\n{tool} ({mode}) failed:\n{result['detail'][-3000:]}")
    print(main_table(rows))
    print(f"\n{TOKENS_DEFINITION}. Peak RSS: the process's resident-set high-water mark over the timed "
          "steps (reset after the warm-up) and over its whole life (model loading included). Targets: "
          f"tether tokens/s >= {TOKENS_TARGET}x TRL, peak RSS (timed steps) <= {MEMORY_TARGET}x TRL.")
    print("\nPhases (median seconds per step, share of the step):\n")
    print(phase_table(rows))
    threads = sorted({t for r in rows if "error" not in r for t in r["threads_seen"]})
    print(f"\ntorch threads seen inside the steps: {threads}; whole run {time.perf_counter() - started:.0f} s")
    if results is not None:
        print(f"rows of run {run} written to {os.path.join(results, NAME + '.jsonl')}")
    if failures:
        print("".join(failures))
    return rows


if __name__ == "__main__":
    main()
