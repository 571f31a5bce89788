"""The run a recipe steps: what is built once from the config (models, sampler, loss,
optimizer, schedule, KL controller, reference updater, reward scorer, logs), validated
before anything is written. ``build_run`` is the "config -> models" part of the recipes.
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
from tether.objectives import GRPOLoss
from tether.train.best import BestEval
from tether.train.config import TrainConfig
from tether.train.data import check_prompt_format, dataset_task
from tether.train.metrics import MetricsLog
from tether.train.rewards import FunctionScorer, TaskScorer, build_scorer, reward_functions
from tether.train.schedule import make_lr_scheduler
from tether.train.setup import Models, build_models, reference_scorer
from tether.train.sharding import Ranks, join_ranks, shard_models, share_run
from tether.train.tasks import Problem, load_task
from tether.train.tool_rollout import check_tool_task, with_episode_limits
from tether.train.tracking import NullTracker


@dataclass
class KLPenalty:
    """The coefficient of the reward-mode KL penalty: what a controller drives when the leash
    is in the reward rather than in the loss (there it drives ``GRPOLoss.kl_coef``)."""

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
    loss: GRPOLoss
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    controller: KLController  # drives ``leash``
    leash: GRPOLoss | KLPenalty  # the object whose kl_coef is the leash's beta
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


def _controller(cfg: TrainConfig, leash: GRPOLoss | KLPenalty) -> Any:
    options = {"adaptive": {"init_kl_coef": cfg.kl_coef, "target": cfg.kl_target, "horizon": cfg.kl_horizon},
               "target": {"init_kl_coef": cfg.kl_coef, "target": cfg.kl_target},
               "budget": {"init_kl_coef": cfg.kl_coef, "target": cfg.kl_target},
               "constant": {"kl_coef": cfg.kl_coef}}
    return make_kl_controller(cfg.kl_controller, model=leash, **lookup(options, cfg.kl_controller, "kl_controller"))


def _loss(cfg: TrainConfig, actor: TransformersWrapper) -> GRPOLoss:
    in_loss = cfg.kl_mode == "loss"
    return GRPOLoss(
        actor, clip_epsilon=(cfg.clip_epsilon, cfg.clip_epsilon_high) if cfg.clip_epsilon_high else cfg.clip_epsilon,
        entropy_bonus=True, entropy_coeff=cfg.entropy_coeff, aggregation=cfg.aggregation,
        kl_estimator=cfg.kl_estimator if in_loss else "k3", kl_to_ref_coeff=cfg.kl_coef if in_loss else None,
        normalizer=cfg.max_new_tokens if cfg.aggregation == "seq-mean-token-sum-norm" else None,
        ratio_level=cfg.ratio_level, dual_clip=cfg.dual_clip or None, importance_cap=cfg.importance_cap,
        importance_correction=None if cfg.importance_correction == "none" else cfg.importance_correction,
    )


def build_run(cfg: TrainConfig) -> Run:
    cfg.validate()
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
    loss = _loss(cfg, TransformersWrapper(models.policy, tok, input_mode="tokens", generate=False,
                                          temperature=cfg.temperature))
    leash = loss if cfg.kl_mode == "loss" else KLPenalty(cfg.kl_coef)
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
        ref_scorer=reference_scorer(models, cfg), loss=loss, optimizer=optimizer,
        scheduler=make_lr_scheduler(optimizer, schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                                    total_steps=cfg.steps),
        controller=_controller(cfg, leash), leash=leash, ref_updater=ref_updater, generator=generator,
        scorer=build_scorer(cfg, task, models.device, functions), metrics=MetricsLog(run_dir / "metrics.jsonl"),
        tracker=NullTracker(run_dir), ranks=ranks,
        line=ReferenceLine(models.policy, models.reference) if cfg.kl_controller == "budget" else None,
    )
    share_run(run)
    return run
