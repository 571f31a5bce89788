"""Ray rollout workers: whole groups per worker, reproducible sampling for a fixed N, pushed
weights, reference log-probs from the shared service, also across service restarts."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
import torch

from tether.models import ReferenceUpdater, TransformersWrapper
from tether.train.config import TrainConfig
from tether.train.recipe_ray import service_scorer, start_workers
from tether.train.run import build_models
from tether.train.tasks import load_task

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]

COUNT_TASK = str(Path(__file__).parents[1] / "train" / "count_task.py")


def tiny_cfg(out: Path, **kw) -> TrainConfig:
    base = dict(model="tiny", task=COUNT_TASK, steps=2, out=str(out), prompts_per_step=3, group_size=2,
                max_new_tokens=5, micro_batch_size=8, eval_size=2, eval_max_new_tokens=4, lora_rank=0,
                learning_rate=1e-3, checkpoint_every=0, threads=1, workers=2)
    base.update(kw)
    return TrainConfig(**base)


def step_chats(cfg: TrainConfig, step: int) -> list:
    task = load_task(cfg.task)
    first = step * cfg.prompts_per_step
    problems = [task.train_problem(cfg.seed, first + i, set()) for i in range(cfg.prompts_per_step)]
    return [p.chat for p in problems for _ in range(cfg.group_size)]


def wait_for_free_cpus(expected: float, timeout_s: float = 20.0) -> float:
    deadline = time.time() + timeout_s
    while ray.available_resources().get("CPU", 0.0) < expected and time.time() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get("CPU", 0.0)


@pytest.fixture(scope="module")
def lora_pool(tmp_path_factory):
    """A LoRA policy whose adapter is perturbed on the learner only, and a pool of 2 workers."""
    cfg = tiny_cfg(tmp_path_factory.mktemp("pool"), lora_rank=4, reference_update="sync")
    models = build_models(cfg)
    with torch.no_grad():
        for param in models.policy.parameters():
            if param.requires_grad:
                param.add_(0.5 * torch.randn_like(param))
    pool = start_workers(cfg)
    yield SimpleNamespace(cfg=cfg, models=models, pool=pool)
    pool.shutdown()
    pool.shutdown()  # a second call does nothing
    assert wait_for_free_cpus(2.0) == 2.0


def reference_of_factory(cfg: TrainConfig, batch) -> torch.Tensor:
    with torch.no_grad():
        return service_scorer(cfg).score(batch["tokens", "full"], batch["masks", "all_attention_mask"]).log_probs


def test_pool_samples_whole_groups_reproducibly_with_the_pushed_weights(lora_pool):
    """Three groups of two over two workers: worker 0 samples groups 0-1 (4 rows), worker 1
    group 2 (2 rows). The same step sampled twice gives identical tokens (seeded per step and
    worker); the sampling log-probs equal the learner's own scoring of the tokens (1e-5: the
    pushed weights were used) and differ from the reference's, which equal local scoring of the
    merged batch (1e-6), one service pass per rollout. After a "sync" reference update the
    service scores with the moved reference: its log-probs equal the policy's, so the KL of the
    next rollout is 0."""
    cfg, models, pool = lora_pool.cfg, lora_pool.models, lora_pool.pool
    updater = ReferenceUpdater(models.policy, models.movable_reference, mode="sync", every=1)
    chats = step_chats(cfg, 0)
    passes = pool.service.forward_calls()
    first = pool.rollout(models.policy, chats, step=0, reference_updater=updater)
    assert [(s.worker, s.batch.batch_size[0]) for s in pool.last_shards] == [(0, 4), (1, 2)]
    again = pool.rollout(models.policy, chats, step=0, reference_updater=updater)
    updater.step(1)
    synced = pool.rollout(models.policy, step_chats(cfg, 1), step=1, reference_updater=updater)
    assert pool.service.forward_calls() - passes == 3
    tokens, attn = first["tokens", "full"], first["masks", "all_attention_mask"]
    response = first["masks", "all_assistant_mask"]
    assert first["history", "prompt"].tolist() == chats
    assert torch.equal(tokens, again["tokens", "full"])
    assert torch.equal(first["log_probs", "full"], again["log_probs", "full"])
    learner = TransformersWrapper(models.policy, models.tokenizer, input_mode="tokens", generate=False)
    with torch.no_grad():
        mine = learner.score(tokens, attn).log_probs
    ref = reference_of_factory(cfg, first)
    torch.testing.assert_close(first["log_probs", "full"][response], mine[response], rtol=0, atol=1e-5)
    assert (first["log_probs", "full"] - ref)[response].abs().max() > 1e-2
    torch.testing.assert_close(first["ref_log_probs", "full"], ref, rtol=0, atol=1e-6)
    moved = synced["masks", "all_assistant_mask"]
    kl = (synced["log_probs", "full"] - synced["ref_log_probs", "full"])[moved]
    assert kl.abs().max() < 1e-5


def restart(pool, pid: int) -> None:
    """Kill the pool's service and return once its rebuilt instance answers (ray.kill is asynchronous)."""
    ray.kill(pool.service.actor, no_restart=False)
    deadline = time.time() + 60
    while pool.service.info().pid == pid:
        assert time.time() < deadline, "the service did not come back"
        time.sleep(0.1)


def test_a_restarted_service_gets_the_moved_reference_again(lora_pool, monkeypatch):
    """A "sync" reference that moved to the perturbed policy. Killed between two rollouts: the
    rebuilt service holds its factory's weights (version None), so the next rollout's sync pushes
    the moved reference again before any scoring. Killed mid-step (after the sync, before the
    workers ask): the new instance scores the step with the factory's weights, the pool sees the
    stale version in the replies, pushes again and rescores. Both steps complete with reference
    log-probs of the moved reference (KL to the policy 0 within float32 rounding, 1e-4), far from the factory's."""
    cfg, models, pool = lora_pool.cfg, lora_pool.models, lora_pool.pool
    updater = ReferenceUpdater(models.policy, models.movable_reference, mode="sync", every=1)
    updater.step(1)
    pool.rollout(models.policy, step_chats(cfg, 0), step=0, reference_updater=updater)
    old = pool.service.info()
    assert old.weights_version is not None

    restart(pool, old.pid)
    between = pool.rollout(models.policy, step_chats(cfg, 1), step=1, reference_updater=updater)
    restarted = pool.service.stats()
    assert restarted.pid != old.pid and restarted.weights_version == old.weights_version
    assert restarted.forward_calls == 1  # the push came first: nothing was scored with stale weights

    push = pool.push_weights

    def restart_then_push(policy):
        restart(pool, restarted.pid)
        return push(policy)

    monkeypatch.setattr(pool, "push_weights", restart_then_push)
    mid = pool.rollout(models.policy, step_chats(cfg, 2), step=2, reference_updater=updater)
    final = pool.service.stats()
    assert final.pid != restarted.pid and final.weights_version == old.weights_version
    assert final.forward_calls >= 2  # the step scored with the factory's weights, then rescored
    assert {s.reference_version for s in pool.last_shards} == {old.weights_version}
    for batch in (between, mid):
        response = batch["masks", "all_assistant_mask"]
        kl = (batch["log_probs", "full"] - batch["ref_log_probs", "full"])[response]
        # Sampling's KV-cache decode and the service's full pass round differently in float32: a
        # few ulps of log-probs near -10 (ulp 1e-6), up to 1.2e-5 on single tokens; a stale
        # reference is 1e-2 away.
        assert kl.abs().max() < 1e-4
        stale = (batch["ref_log_probs", "full"] - reference_of_factory(cfg, batch))[response]
        assert stale.abs().max() > 1e-2
