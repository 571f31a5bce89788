"""The run a recipe steps: built once from the config, opened, checkpointed and closed.

``build_run`` is the "config -> models" part of the recipes: models, sampler, the policy's scorer
for the loss pass, optimizer, schedule, KL controller, reference updater, the reward and logs,
validated before anything is written. ``open_run`` starts the run directory (or resumes from its
newest checkpoint), ``close_step`` logs and checkpoints each step at its cadence, ``close_run``
runs the final evaluation and writes the summary. A checkpoint holds the state beyond the weights
and a resume puts every piece back (RNGs, controller, schedule, reference updater, weight average,
best eval, logs cut back to the checkpoint's step), so a resumed run ends bit-identical to one
that was never stopped (on CPU). With a sharded learner, rank 0 alone writes the run directory.

``--model`` is read by ``tether.models.loading.load_base`` (offline, safetensors only). With LoRA the reference is the policy with its adapter disabled
unless it has to move (``sync``); full fine-tuning and a continued adapter (``cfg.adapter``) take
a ``frozen_copy``. ``Models.fingerprint`` identifies the base weights and tokenizer as loaded, so
a checkpoint refuses another base of the same shapes. The learning rate's schedule is
``tether.train.updates.make_lr_scheduler``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from tether._compat import enable_gradient_checkpointing, peft_model
from tether.control import KLController, make_kl_controller
from tether.control.budget import ReferenceLine
from tether.integrations.trackers import NullTracker, make_tracker
from tether.models import ReferenceUpdater, TransformersWrapper, adapter_disabled, frozen_copy
from tether.models.records import StepRecord
from tether.models.loading import adapter_digest, fingerprint, load_adapter, load_base
from tether.ops.checks import lookup, real_number
from tether.train.averaging import WeightAverage, weight_average
from tether.train.checkpoint import checkpoint_record, newest_intact, open_checkpoint, read_state, save_checkpoint
from tether.train.periodic_eval import BestEval, periodic_eval
from tether.train.run_dir import best_root, check_new_run_dir, clear_run_dir, write_config, write_run_start
from tether.train.config import TrainConfig
from tether.train.host_memory import fix_mmap_threshold
from tether.train.metrics import CompletionLog, MetricsLog, evaluate_run, held_out_metrics, summarize
from tether.train.plots import plot_metrics
from tether.train.rewards import FunctionReward, RewardFunction, TaskReward, build_reward, reward_functions
from tether.train.run_state import restarts
from tether.train.sharding import (Ranks, join_ranks, load_generator_state, resolve_device, resolve_dtype, shard_models,
                                   share_run)
from tether.train.data import check_data, check_prompt_format, dataset_task
from tether.train.tasks import IN_MEMORY, Problem, load_task, with_episode_limits
from tether.train.updates import make_lr_scheduler
from tether.train.variants import BudgetLR, MovingReference, budget_lr, moving_reference, original_model


@dataclass
class Leash:
    """The leash's beta: the KL coefficient a controller drives, read by the recipe's loss term
    (``kl_mode=loss``) or its per-token reward penalty (``kl_mode=reward``)."""

    kl_coef: float


@dataclass
class Run:
    """Everything a step needs, built once from the config."""

    cfg: TrainConfig
    dir: Path
    task: Any  # a tether.train.tasks.Task, or a tether.train.data.DatasetTask with --dataset
    held_out: list[Problem]
    models: Models
    sampler: TransformersWrapper
    ref_scorer: TransformersWrapper
    actor: TransformersWrapper  # the policy's log-probs and entropy in the loss pass, with gradients
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    controller: KLController  # drives ``leash``
    leash: Leash
    ref_updater: ReferenceUpdater | None
    generator: torch.Generator
    reward: TaskReward | FunctionReward
    metrics: MetricsLog
    best: BestEval = field(default_factory=BestEval)
    tracker: Any = None  # TensorBoard (report_to) or a no-op; train() opens it
    ranks: Ranks = field(default_factory=Ranks)  # the sharded learner's processes (tether.train.sharding)
    line: ReferenceLine | None = None  # the weights the budget and the ceiling kl_bound move toward the reference
    moving: MovingReference | None = None  # reference_move: the mover and the line to the original model
    lr_follow: BudgetLR | None = None  # kl_adaptive_lr: the multiplier on the schedule's learning rate
    average: WeightAverage | None = None  # weight_average: the running average of the kept weights
    excluded: frozenset[str] = field(init=False)  # keys of the held-out problems, never drawn for training

    def __post_init__(self) -> None:
        self.excluded = frozenset(p.key for p in self.held_out)


# A rollout stage: the step's records of a rank's problems (the recipe's ``sample``, or another topology's).
Rollout = Callable[[Run, list[Problem], int], StepRecord]


def _controller(cfg: TrainConfig, leash: Leash) -> Any:
    options = {"adaptive": {"init_kl_coef": cfg.kl_coef, "target": cfg.kl_target, "horizon": cfg.kl_horizon},
               "target": {"init_kl_coef": cfg.kl_coef, "target": cfg.kl_target},
               "budget": {"init_kl_coef": cfg.kl_coef, "target": cfg.kl_target, "band": cfg.kl_band,
                          "push": cfg.kl_push, "max_scale": cfg.kl_max_scale, "max_forwards": cfg.kl_max_forwards},
               "constant": {"kl_coef": cfg.kl_coef}}
    return make_kl_controller(cfg.kl_controller, model=leash, **lookup(options, cfg.kl_controller, "kl_controller"))


@dataclass(frozen=True)
class Inputs:
    """Data and reward functions given as Python objects (``tether.train.train``) rather than as
    files; the config records them as ``python:...`` so that a resume must hand them over again."""

    rows: list[dict[str, Any]] | None = None
    eval_rows: list[dict[str, Any]] | None = None
    functions: list[RewardFunction] | None = None

    def check(self, cfg: TrainConfig) -> None:
        """Refuse a config naming Python inputs that were not given (a resume from the command line)."""
        given = {"dataset": self.rows, "eval_dataset": self.eval_rows, "reward_funcs": self.functions}
        for name, value in given.items():
            if getattr(cfg, name).startswith(IN_MEMORY) and value is None:
                raise ValueError(f"{name}: this run's {name} was given as Python objects ({getattr(cfg, name)}); "
                                 f"resume it with tether.train.train(..., {name}=..., resume=True) and the same objects.")


def build_run(cfg: TrainConfig, *, fresh: bool = False, inputs: Inputs | None = None) -> Run:
    """The run of ``cfg``; ``fresh``: refuse an ``out`` that holds a run (a new run, not a resume);
    ``inputs``: data and reward functions given as Python objects."""
    cfg.validate()
    inputs = Inputs() if inputs is None else inputs
    inputs.check(cfg)
    if fresh:  # every rank checks before the first collective: after it, rank 0 writes config.yaml
        check_new_run_dir(cfg)
    ranks = join_ranks(cfg)  # first: a CUDA rank picks its GPU before anything is loaded
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    task = dataset_task(cfg, inputs.rows, inputs.eval_rows) if cfg.dataset else load_task(cfg.task)
    functions = reward_functions(cfg, task, inputs.functions)  # before the models: a dataset lacking a column fails first
    models = build_models(cfg)
    if models.device.type == "cpu":  # the steps' tensors live in host memory: freed blocks go back to the OS
        fix_mmap_threshold(cfg.host_mmap_threshold)
    shard_models(models, ranks)  # before the optimizer takes the parameters
    tok = models.tokenizer
    check_prompt_format(cfg.prompt_format, tok, cfg.model)
    task = with_episode_limits(task, cfg, tok)
    generator = torch.Generator(device=models.device).manual_seed(cfg.seed)  # multinomial needs its device's RNG
    sampler = TransformersWrapper(
        models.policy, tok, input_mode="history" if cfg.prompt_format == "chat" else "text",
        generate=True, temperature=cfg.temperature,
        generate_kwargs={"max_new_tokens": cfg.max_new_tokens, "generator": generator},
    )
    actor = TransformersWrapper(models.policy, tok, input_mode="tokens", generate=False, temperature=cfg.temperature)
    leash = Leash(cfg.kl_coef)
    optimizer = torch.optim.AdamW([p for p in models.policy.parameters() if p.requires_grad],
                                  lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    ref_updater = None
    if models.movable_reference is not None:
        ref_updater = ReferenceUpdater(models.policy, models.movable_reference, mode=cfg.reference_update,
                                       every=cfg.reference_every,
                                       alpha=cfg.reference_alpha if cfg.reference_update == "ema" else None)
    run_dir = Path(cfg.out)  # created by train() once everything has loaded
    run = Run(
        cfg=cfg, dir=run_dir, task=task, held_out=task.eval_set(cfg.eval_size), models=models, sampler=sampler,
        ref_scorer=reference_scorer(models, cfg), actor=actor, optimizer=optimizer,
        scheduler=make_lr_scheduler(optimizer, schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                                    total_steps=cfg.steps),
        controller=_controller(cfg, leash), leash=leash, ref_updater=ref_updater, generator=generator,
        reward=build_reward(cfg, task, models.device, functions), metrics=MetricsLog(run_dir / "metrics.jsonl"),
        tracker=NullTracker(run_dir), ranks=ranks,
        line=ReferenceLine(models.policy, models.reference) if cfg.kl_controller == "budget" or cfg.kl_bound else None,
        moving=moving_reference(cfg, models), lr_follow=budget_lr(cfg), average=weight_average(cfg, models.policy),
    )
    share_run(run)
    return run


# ------------------------------------------------------------------------------ the run's life
def _state(run: Run, step: int, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "data_cursor": step * run.cfg.prompts_per_step,
        "controller": run.controller.state_dict(),
        # The moved reference weights go to reference.safetensors, not into state.json.
        "reference_updater": run.ref_updater.state_dict(with_tensors=False) if run.ref_updater else None,
        **({"reference_move": run.moving.mover.state_dict()} if run.moving else {}),
        **({"lr_multiplier": run.lr_follow.multiplier} if run.lr_follow else {}),
        "lr_scheduler": run.scheduler.state_dict(),
        "best_eval": run.best.state_dict(),
        **extra,
    }


def save_run(run: Run, step: int, extra: dict[str, Any], *, root: Path | None = None, keep: int | None = None) -> None:
    """Checkpoint ``run`` after ``step`` steps (``extra``: entries for state.json) under ``root``."""
    rng = {"torch": torch.get_rng_state(), "sampling": run.generator.get_state()}  # equal on every rank
    save_checkpoint(root or run.dir, step, policy=run.models.policy, optimizer=run.optimizer,
                    state=_state(run, step, extra), rng=rng, reference=run.models.movable_reference,
                    keep=keep or run.cfg.keep_checkpoints,
                    average=None if run.average is None else run.average.state_dict())


def restore_run(run: Run) -> tuple[int, dict[str, Any]]:
    """Load the newest intact checkpoint into ``run``; returns its step and state."""
    ckpt, rng = open_checkpoint(run.cfg, run.models, run.optimizer, set_aside=run.ranks.writer)
    if ckpt.step > run.cfg.steps:
        raise ValueError(f"steps: {run.cfg.steps} is below the step of {ckpt.path} ({ckpt.step}); "
                         f"a resume can only extend a run, so give steps >= {ckpt.step}.")
    torch.set_rng_state(rng["torch"])
    load_generator_state(run.generator, rng["sampling"], ckpt.path)
    run.controller.load_state_dict(ckpt.state["controller"])
    if run.ref_updater is not None and ckpt.state.get("reference_updater"):
        run.ref_updater.load_state_dict(ckpt.state["reference_updater"])
    if run.moving is not None:
        run.moving.mover.load_state_dict(ckpt.state["reference_move"])
    if run.average is not None:
        run.average.load(ckpt.path / "average.safetensors")
    if run.lr_follow is not None:  # the optimizer's saved rates already carry it
        run.lr_follow.multiplier = real_number("lr_multiplier", ckpt.state["lr_multiplier"], low=0, low_open=True)
    if "lr_scheduler" in ckpt.state:
        run.scheduler.load_state_dict(ckpt.state["lr_scheduler"])
    run.best.load_state_dict(ckpt.state.get("best_eval"))
    check_data(ckpt.state, run.task, ckpt.path)
    if run.ranks.writer:
        run.metrics.truncate_after(ckpt.step)
        CompletionLog(run.dir).truncate_after(ckpt.step)
        write_config(run.dir, run.cfg)  # a resume may have changed steps or the checkpoint cadence
    return ckpt.step, ckpt.state


@dataclass(frozen=True)
class Opened:
    """Where an opened run starts: its first step, the evaluation before training, the entries
    every checkpoint's state.json carries, the wall clock at the start, and whether the held-out
    evaluations show a progress bar."""

    start: int
    eval_before: dict[str, Any]
    extra: dict[str, Any]
    wall: float
    progress: bool = False


def open_run(run: Run, *, resume: bool, progress: bool = False) -> Opened:
    """Open the run's trackers, then resume ``run`` from its newest checkpoint, or start its
    directory and evaluate the untrained policy (``progress``: with a progress bar on the writing
    rank). A resume of a run with no checkpoint yet starts it again (``run_state.restarts``).
    The trackers open first: one that cannot start fails before the run directory is written."""
    cfg, wall, progress = run.cfg, time.perf_counter(), progress and run.ranks.writer
    restart = resume and restarts(cfg, say=run.ranks.writer)  # read from files no rank has written yet
    resume = resume and not restart
    if not resume:
        run.ranks.on_writer(lambda: clear_run_dir(cfg, restart=restart))
    if run.ranks.writer:
        step = int(read_state(newest_intact(run.dir)[0])["step"]) if resume else None
        run.tracker = make_tracker(cfg.report_to, run.dir, resume_step=step, config=dataclasses.asdict(cfg))
    if resume:
        start, state = restore_run(run)
        before = state["eval_before"]
    else:
        run.ranks.on_writer(lambda: write_run_start(cfg))
        before, start = evaluate_run(run, None, with_kl=False, progress=progress), 0
        run.tracker.scalars({"step": 0, **held_out_metrics(before, with_kl=False)})
    extra = {"eval_before": before, **checkpoint_record(cfg, run.models.fingerprint),
             "data": getattr(run.task, "fingerprint", None)}
    return Opened(start, before, extra, wall, progress)


def close_step(run: Run, opened: Opened, line: dict[str, Any]) -> None:
    """After a step: the periodic evaluation (and best checkpoint), the metrics line logged, and the
    checkpoint at its cadence (always after the last step)."""
    cfg, done = run.cfg, line["step"]
    if periodic_eval(run, done, line):
        save_run(run, done, opened.extra, root=best_root(run.dir), keep=1)
    if run.ranks.writer:
        run.metrics.append(line)
    run.tracker.scalars(line)
    if done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
        save_run(run, done, opened.extra)


def close_run(run: Run, opened: Opened) -> dict[str, Any]:
    """The final evaluation, then ``summary.json`` and the plots; returns the summary ({} on a
    rank that does not write)."""
    after = evaluate_run(run, original_model(run), progress=opened.progress)
    if not run.ranks.writer:
        return {}
    run.tracker.scalars({"step": run.cfg.steps, **held_out_metrics(after)})
    summary = summarize(run, opened.eval_before, after, time.perf_counter() - opened.wall)
    # Atomically: a run is finished once summary.json is there (a kill while it is written leaves none).
    (run.dir / ".summary.json.tmp").write_text(json.dumps(summary, indent=1))
    os.replace(run.dir / ".summary.json.tmp", run.dir / "summary.json")
    plot_metrics(run.dir)  # they draw the held-out markers from summary.json
    return summary


# ------------------------------------------------------------------------------ models
class AdapterNote(UserWarning):
    """A continued adapter's own rank, alpha and targets replace lora_rank, lora_alpha and lora_targets."""


@dataclass
class Models:
    policy: nn.Module
    reference: nn.Module
    tokenizer: Any
    # The reference's own weights, when it is a separate copy that an update policy moves.
    movable_reference: nn.Module | None
    fingerprint: dict[str, str] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")  # where the policy's weights live


def build_models(cfg: TrainConfig) -> Models:
    """Policy, reference and tokenizer for ``cfg``: base from ``cfg.model`` in ``cfg.dtype`` on
    ``cfg.device``, then a new LoRA adapter, the one in ``cfg.adapter``, or full fine-tuning."""
    device = resolve_device(cfg.device)  # first: a refused device costs no model load
    base, tokenizer = load_base(cfg.model, cfg.seed, resolve_dtype(cfg.dtype))
    base.eval()  # RL needs sampling and scoring to agree: no dropout anywhere
    prints = fingerprint(base, tokenizer)
    base.to(device)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(base)
    if cfg.adapter:
        return _continued_adapter(base, tokenizer, cfg, prints, device)
    if cfg.lora_rank == 0:
        base.requires_grad_(True)
        reference = frozen_copy(base)
        movable = reference if cfg.reference_moves else None
        return Models(base, reference, tokenizer, movable, prints, device)
    import peft

    targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    check_lora_targets(base, targets, cfg.model)
    torch.manual_seed(cfg.seed)
    lora = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=targets)
    policy = peft_model(base, lora).eval()
    if not cfg.reference_moves:
        return Models(policy, adapter_disabled(policy), tokenizer, None, prints, device)
    reference = frozen_copy(policy)
    return Models(policy, reference, tokenizer, reference, prints, device)


def check_lora_targets(model: nn.Module, targets: list[str], where: str) -> None:
    """Every name of ``lora_targets`` is a module of ``model`` (its full name or its last parts, as
    PEFT matches them); a ``ValueError`` lists the model's linear module names. PEFT refuses only
    when no name matches, with a traceback, and passes over the others in silence."""
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing and targets:
        return
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if type(module).__name__ in ("Linear", "Conv1D")} - {"lm_head"})
    raise ValueError(f"lora_targets: {', '.join(missing) or 'nothing'} names no module of model {where!r}; its "
                     f"linear modules are {', '.join(linear)}. Name some of them, e.g. "
                     f"lora_targets={','.join(linear[:2])}, or train every weight with lora_rank=0.")


def _continued_adapter(base: nn.Module, tokenizer: Any, cfg: TrainConfig, prints: dict[str, str],
                       device: torch.device) -> Models:
    """The policy continues the saved adapter; the reference is that policy as loaded, frozen.

    Not the base with the adapter disabled: the leash holds the policy near where this run
    starts, and pulling it back to the base would undo the adapter's earlier training. The
    frozen copy costs one more copy of the weights.
    """
    if cfg.lora_rank == 0:
        raise ValueError(f"adapter: {cfg.adapter!r} trains a LoRA adapter, but lora_rank=0 asks to train every "
                         "weight; drop adapter, or leave lora_rank at a positive value.")
    policy = load_adapter(base, cfg.adapter).eval()
    lora = policy.peft_config["default"]
    warnings.warn(f"adapter {cfg.adapter}: continuing its LoRA (rank {lora.r}, alpha {lora.lora_alpha}, targets "
                  f"{sorted(lora.target_modules)}); lora_rank, lora_alpha and lora_targets are not used.",
                  AdapterNote, stacklevel=2)
    prints = {**prints, "adapter": adapter_digest(policy)}
    reference = frozen_copy(policy)
    movable = reference if cfg.reference_moves else None
    return Models(policy, reference, tokenizer, movable, prints, device)


def reference_scorer(models: Models, cfg: TrainConfig) -> TransformersWrapper:
    """Scoring wrapper of ``models.reference``: log-probs under ``ref_log_probs`` at the sampling temperature."""
    return TransformersWrapper(models.reference, models.tokenizer, input_mode="tokens", generate=False,
                               temperature=cfg.temperature, log_probs_key="ref_log_probs")
