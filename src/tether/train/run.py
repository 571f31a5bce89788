"""The run a recipe steps: what is built once from the config (models, sampler, the policy's
scorer for the loss pass, optimizer, schedule, KL controller, reference updater, reward
scorer, logs), validated before anything is written. ``build_run`` is the "config -> models"
part of the recipes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tether.control import KLController, make_kl_controller
from tether.ops.registry import lookup
from tether.models import ReferenceUpdater, TransformersWrapper
from tether.models.reference_line import ReferenceLine
from tether.train.checkpoint import BestEval, check_new_run_dir
from tether.train.config import TrainConfig
from tether.train.metrics import MetricsLog, NullTracker
from tether.train.rewards import FunctionScorer, TaskScorer, build_scorer, reward_functions
from tether.train.schedule import make_lr_scheduler
from tether.train.setup import Models, build_models, reference_scorer
from tether.train.sharding import Ranks, join_ranks, shard_models, share_run
from tether.train.tasks import Problem, check_prompt_format, check_tool_task, dataset_task, load_task, with_episode_limits


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
    task: Any  # a tether.train.tasks.Task, or a tether.train.tasks.DatasetTask with --dataset
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
    scorer: TaskScorer | FunctionScorer
    metrics: MetricsLog
    best: BestEval = field(default_factory=BestEval)
    tracker: Any = None  # TensorBoard (report_to) or a no-op; train() opens it
    ranks: Ranks = field(default_factory=Ranks)  # the sharded learner's processes (tether.train.sharding)
    line: ReferenceLine | None = None  # kl_controller=budget: the weights it moves toward the reference

    @property
    def excluded(self) -> set[str]:
        """Keys of the held-out problems, never drawn for training."""
        return {p.key for p in self.held_out}


def _controller(cfg: TrainConfig, leash: Leash) -> Any:
    options = {"adaptive": {"init_kl_coef": cfg.kl_coef, "target": cfg.kl_target, "horizon": cfg.kl_horizon},
               "target": {"init_kl_coef": cfg.kl_coef, "target": cfg.kl_target},
               "budget": {"init_kl_coef": cfg.kl_coef, "target": cfg.kl_target},
               "constant": {"kl_coef": cfg.kl_coef}}
    return make_kl_controller(cfg.kl_controller, model=leash, **lookup(options, cfg.kl_controller, "kl_controller"))


def build_run(cfg: TrainConfig, *, fresh: bool = False) -> Run:
    """The run of ``cfg``; ``fresh``: refuse an ``out`` that holds a run (a new run, not a resume)."""
    cfg.validate()
    if fresh:  # every rank checks before the first collective: after it, rank 0 writes config.yaml
        check_new_run_dir(cfg)
    ranks = join_ranks(cfg)  # first: a CUDA rank picks its GPU before anything is loaded
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    task = dataset_task(cfg) if cfg.dataset else load_task(cfg.task)
    check_tool_task(task, cfg.workers)
    functions = reward_functions(cfg, task)  # before the models: a dataset lacking a column fails first
    models = build_models(cfg)
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
        scorer=build_scorer(cfg, task, models.device, functions), metrics=MetricsLog(run_dir / "metrics.jsonl"),
        tracker=NullTracker(run_dir), ranks=ranks,
        line=ReferenceLine(models.policy, models.reference) if cfg.kl_controller == "budget" else None,
    )
    share_run(run)
    return run
