"""The multi-turn tool task on Ray rollout workers: each worker runs ``MultiTurnRollout`` on its
groups, as one process would with that worker's seed, and ``tether train --workers`` trains on it.

Its own module: a pool holds the session cluster's CPUs until its module ends.
"""

from __future__ import annotations

import pytest
import torch

from tests.ray.test_workers import wait_for_free_cpus
from tests.train.test_tool_task import cfg as tool_cfg
from tether.llm import chat_batch
from tether.models import TransformersWrapper
from tether.ray import merge_batches, split_groups, worker_seed
from tether.rollout import MultiTurnRollout
from tether.train import recipe_ray
from tether.train.metrics import MetricsLog
from tether.train.run import build_models, build_run
from tether.train.tasks import load_task

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]


def test_workers_run_the_tool_tasks_episodes_as_one_process_would(tmp_path):
    """Three groups of two on two workers, ``arithmetic-tools`` with 2 turns and 600 tokens a
    conversation: the merged batch equals, entry for entry, ``MultiTurnRollout`` run in this
    process on each worker's groups with that worker's seed (tokens, assistant masks, sampling
    log-probs, episode counters and end reasons), and the reference log-probs equal local scoring."""
    cfg = tool_cfg(tmp_path / "run", prompts_per_step=3, max_new_tokens=12, workers=2, max_turns=2,
                   max_episode_tokens=600)
    use = build_run(cfg).task.tool_use
    assert (use.max_turns, use.max_tokens) == (2, 600)
    models = build_models(cfg)
    task = load_task(cfg.task)
    chats = [p.chat for p in (task.train_problem(cfg.seed, i, set()) for i in range(3)) for _ in range(2)]
    pool = recipe_ray.start_workers(cfg, use)
    try:
        merged = pool.rollout(models.policy, chats, step=0)
    finally:
        pool.shutdown()
    parts = []
    for w, groups in enumerate(split_groups(3, 2)):
        sampler = TransformersWrapper(
            models.policy, models.tokenizer, generate=True, temperature=cfg.temperature, padding_side="left",
            generate_kwargs={"max_new_tokens": cfg.max_new_tokens,
                             "generator": torch.Generator().manual_seed(worker_seed(cfg.seed, 0, w))})
        batch = chat_batch(chats[groups.start * 2 : groups.stop * 2], key=("history", "prompt"))
        with torch.no_grad():
            MultiTurnRollout(sampler, list(use.tools), max_turns=use.max_turns, max_tokens=use.max_tokens)(batch)
        parts.append(batch)
    local = merge_batches(parts, pad_id=sampler.pad_id)
    for key in (("tokens", "full"), ("masks", "all_attention_mask"), ("masks", "all_assistant_mask"),
                ("log_probs", "full"), ("episode", "turns"), ("episode", "tool_calls"), ("episode", "tool_errors")):
        assert torch.equal(merged[key], local[key]), key
    assert merged["episode", "end"].tolist() == local["episode", "end"].tolist()
    assert merged["history", "full"].tolist() == local["history", "full"].tolist()
    mask = merged["masks", "all_attention_mask"]
    with torch.no_grad():
        ref = recipe_ray.service_scorer(cfg).score(merged["tokens", "full"], mask).log_probs
    torch.testing.assert_close(merged["ref_log_probs", "full"], ref, rtol=0, atol=1e-6)
    assert wait_for_free_cpus(2.0) == 2.0


def test_train_with_workers_on_the_tool_task(tmp_path):
    """``--task arithmetic-tools --workers 2``: every step's line has the tool statistics, and
    step 1's sampled KL, summed over the assistant tokens only, is 0 (policy == reference)."""
    cfg = tool_cfg(tmp_path / "run", max_new_tokens=12, workers=2, eval_size=2)
    with pytest.warns(UserWarning, match="sampled KL"):
        summary = recipe_ray.train(cfg, progress=False)
    records = MetricsLog(tmp_path / "run" / "metrics.jsonl").read()
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["turns_per_episode"] >= 1 and 0 <= record["tool_call_rate"] <= 1
        assert record["kl_signal"] == "sampled"
    assert records[0]["kl_per_seq"] == pytest.approx(0.0, abs=1e-5)
    assert "eval_tool_call_rate_after" in summary
    assert wait_for_free_cpus(2.0) == 2.0
