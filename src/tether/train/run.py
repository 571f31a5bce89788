"""The run a recipe steps: everything built once from the config (models, sampler, loss,
optimizer, controller, reference updater, scorer, schedule), validated before anything is
written. ``build_run`` is the "config -> models" part of ``tether.train.recipe``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tether.control import make_kl_controller
from tether.models import ReferenceUpdater, TransformersWrapper
from tether.objectives import GRPOLoss
from tether.train.best import BestEval
from tether.train.config import TrainConfig
from tether.train.data import check_prompt_format, dataset_task
from tether.train.metrics import MetricsLog
from tether.train.rewards import build_scorer
from tether.train.schedule import make_lr_scheduler
from tether.train.setup import build_models, reference_scorer
from tether.train.sharding import Ranks, join_ranks, shard_models, share_run
from tether.train.tasks import Problem, load_task
from tether.train.tool_rollout import check_tool_task
from tether.train.tracking import NullTracker


@dataclass
class Run:
    """Everything a step needs, built once from the config."""

    cfg: TrainConfig
    dir: Path
    task: Any  # a Task, or a tether.train.data.DatasetTask with --dataset
    held_out: list[Problem]
    excluded: set[str]
    models: Any
    sampler: TransformersWrapper
    ref_scorer: TransformersWrapper
    loss: GRPOLoss
    optimizer: torch.optim.Optimizer
    controller: Any
    coef: Any  # object whose kl_coef the controller drives
    ref_updater: ReferenceUpdater | None
    generator: torch.Generator
    metrics: MetricsLog
    workers: Any = None  # tether.ray.RolloutPool when cfg.workers > 0, else rollouts run in-process
    scheduler: Any = None  # the learning-rate schedule, stepped once per training step
    best: BestEval | None = None
    tracker: Any = None  # TensorBoard (report_to) or a no-op; opened by train()
    scorer: Any = None  # tether.train.rewards: the task's reward, or --reward-funcs / --reward-model
    ranks: Ranks = field(default_factory=Ranks)  # the sharded learner's ranks (tether.train.sharding)


def build_run(cfg: TrainConfig) -> Run:
    cfg.validate()
    ranks = join_ranks(cfg)  # first: a CUDA rank picks its GPU before anything is loaded
    run_dir = Path(cfg.out)  # created by train() once everything has loaded
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    task = dataset_task(cfg) if cfg.dataset else load_task(cfg.task)
    check_tool_task(task, cfg.workers)
    held_out = task.eval_set(cfg.eval_size)
    models = build_models(cfg)
    shard_models(models, ranks)  # before the optimizer takes the parameters
    tok = models.tokenizer
    check_prompt_format(cfg.prompt_format, tok, cfg.model)
    scorer = build_scorer(cfg, task, models.device)
    generator = torch.Generator(device=models.device).manual_seed(cfg.seed)  # multinomial needs its device's RNG
    sampler = TransformersWrapper(
        models.policy, tok, input_mode="history" if cfg.prompt_format == "chat" else "text",
        generate=True, temperature=cfg.temperature,
        generate_kwargs={"max_new_tokens": cfg.max_new_tokens, "generator": generator},
    )
    actor = TransformersWrapper(models.policy, tok, input_mode="tokens", generate=False, temperature=cfg.temperature)
    ref_scorer = reference_scorer(models, cfg)
    clip = (cfg.clip_epsilon, cfg.clip_epsilon_high) if cfg.clip_epsilon_high else cfg.clip_epsilon
    loss = GRPOLoss(
        actor, clip_epsilon=clip, entropy_bonus=True, entropy_coeff=cfg.entropy_coeff,
        aggregation=cfg.aggregation, kl_estimator=cfg.kl_estimator if cfg.kl_mode == "loss" else "k3",
        kl_to_ref_coeff=cfg.kl_coef if cfg.kl_mode == "loss" else None,
        normalizer=cfg.max_new_tokens if cfg.aggregation == "seq-mean-token-sum-norm" else None,
        ratio_level=cfg.ratio_level, dual_clip=cfg.dual_clip or None, importance_cap=cfg.importance_cap,
        importance_correction=None if cfg.importance_correction == "none" else cfg.importance_correction,
    )
    coef = loss if cfg.kl_mode == "loss" else SimpleNamespace(kl_coef=cfg.kl_coef)
    if cfg.kl_controller == "adaptive":
        controller = make_kl_controller("adaptive", init_kl_coef=cfg.kl_coef, target=cfg.kl_target,
                                        horizon=cfg.kl_horizon, model=coef)
    elif cfg.kl_controller == "target":
        controller = make_kl_controller("target", init_kl_coef=cfg.kl_coef, target=cfg.kl_target, model=coef)
    else:
        controller = make_kl_controller("constant", kl_coef=cfg.kl_coef, model=coef)
    trainable = [p for p in models.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    ref_updater = None
    if models.movable_reference is not None:
        alpha = cfg.reference_alpha if cfg.reference_update == "ema" else None
        ref_updater = ReferenceUpdater(models.policy, models.movable_reference, mode=cfg.reference_update,
                                       every=cfg.reference_every, alpha=alpha)
    workers = None
    if cfg.workers > 0:
        from tether.train.distributed import start_workers  # Ray is optional: imported only when asked for

        workers = start_workers(cfg)
    scheduler = make_lr_scheduler(optimizer, schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                                  total_steps=cfg.steps)
    run = Run(cfg, run_dir, task, held_out, {p.key for p in held_out}, models, sampler, ref_scorer,
              loss, optimizer, controller, coef, ref_updater, generator, MetricsLog(run_dir / "metrics.jsonl"),
              workers=workers, scheduler=scheduler, best=BestEval(), tracker=NullTracker(run_dir), scorer=scorer,
              ranks=ranks)
    share_run(run)
    return run
