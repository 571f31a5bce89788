"""TRL's side of ``e2e_grpo.py``: ``GRPOTrainer.train()`` on the same workload, one step a call.

``setup_trl`` is the child ``e2e_grpo.measure`` times in a fresh process for a TRL row: the
trainer runs in a worker thread that each timed call releases for exactly one step (between its
``on_step_begin`` and ``on_step_end`` callbacks), with the settings docs/performance.md lists
as the same for both tools. Run it through ``e2e_grpo.py``, which also needs TRL's venv
(``.venv-bench``).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import tempfile
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import cap_memory  # noqa: E402
from e2e_grpo import step_problems, train_config  # noqa: E402  (also sets the offline flags)
from step_clock import PhaseClock, append_step, memory_peaks  # noqa: E402


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
        append_step(info_path, {**counts, "phases": phases, "threads": gate.threads, **memory_peaks(clock)})

    step.keep_alive = output_dir  # the trainer's output directory lives as long as the callable
    return step
