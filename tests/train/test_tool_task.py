"""``--task arithmetic-tools``: the task, a recipe step on multi-turn episodes with tool calls,
and a tiny-model smoke run of ``tether train``."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from tests.llm.naive import naive_logprobs
from tether.rollout import MultiTurnRollout
from tether.train.config import TrainConfig
from tether.train.recipe import build_run, train, train_step
from tether.train.tasks import TASKS, load_task
from tether.train.tool_rollout import check_tool_task
from tether.train.tool_task import SYSTEM_PROMPT

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


def cfg(out, **kw) -> TrainConfig:
    base = dict(model="tiny", task="arithmetic-tools", steps=2, out=str(out), prompts_per_step=2, group_size=2,
                max_new_tokens=96, micro_batch_size=2, eval_size=3, eval_max_new_tokens=8, lora_rank=0,
                learning_rate=1e-3, checkpoint_every=0, threads=1)
    base.update(kw)
    return TrainConfig(**base)


def test_task_problems_and_reward():
    task = load_task("arithmetic-tools")
    assert "arithmetic-tools" in TASKS and task.tool_use.tools == ("calculator",) and task.tool_use.max_turns == 3
    problem = task.train_problem(0, 0, set())
    a, b = map(int, re.fullmatch(r"What is (\d+) \* (\d+)\?", problem.chat[-1]["content"]).groups())
    assert 100 <= a <= 999 and 10 <= b <= 99 and problem.answer == str(a * b)
    assert problem.chat[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert task.reward(f"The answer is {a * b}.", problem) == 1.0
    assert task.reward(f"{a * b + 1}", problem) == 0.0 and task.reward(CALL % f"{a} * {b}", problem) == 0.0
    assert task.is_correct(f"{a * b:,}", problem)  # thousands separators are read as one number


def scripted_turn(self, rows, limits):
    """Problems with an even ``a`` call the calculator, then answer with its result; the others
    answer 7. Log-probs are the tiny model's own, so the step is on-policy for forced replies."""
    tok, model = self.policy.tokenizer, self.policy.model
    out = []
    for row, limit in zip(rows, limits):
        text = tok.decode(row)
        a, b = re.findall(r"What is (\d+) \* (\d+)\?", text)[-1]  # after the prompt's worked example
        calls = text.split("<|im_start|>user")[-1].count("<|im_start|>assistant") - 1
        if int(a) % 2 == 0 or calls:  # the script depends only on the prompt and the turn
            reply = CALL % f"{a} * {b}" if calls == 0 else re.findall(r"tool\n(\d+)", text)[-1]
        else:
            reply = "7"
        ids = tok(reply)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            lp = naive_logprobs(model, torch.tensor(row + ids), temperature=self.policy.temperature)[len(row):]
        out.append((ids, lp.float().tolist(), True))
    return out


def test_recipe_step_on_scripted_tool_episodes(tmp_path, monkeypatch):
    monkeypatch.setattr(MultiTurnRollout, "sample_turn", scripted_turn)
    run = build_run(cfg(tmp_path / "run", prompts_per_step=4))
    record = train_step(run, 0)
    problems = [run.task.train_problem(0, i, run.excluded) for i in range(4)]  # the step's 4 problems, unrepeated
    callers = [int(p.answer) for p in problems if int(p.chat[-1]["content"].split()[2]) % 2 == 0]
    rate = len(callers) / 4
    assert 0 < rate < 1, "choose a seed with both kinds of problems"
    assert record["tool_call_rate"] == rate and record["tool_calls_per_episode"] == rate
    assert record["turns_per_episode"] == 1 + rate and record["tool_error_rate"] == 0.0
    assert record["accuracy"] == rate and record["reward_mean"] == rate
    assert record["kl_per_seq"] == pytest.approx(0.0, abs=1e-4)  # policy == reference before the update
    assert math.isfinite(record["loss"]) and record["grad_norm"] > 0


def test_train_smoke_on_the_tiny_model(tmp_path):
    summary = train(cfg(tmp_path / "run"), progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        keys = [k for k in record if "tool" in k or "turn" in k]
        assert set(keys) == {"tool_call_rate", "tool_calls_per_episode", "tool_error_rate", "turns_per_episode"}
        assert record["turns_per_episode"] >= 1 and 0 <= record["tool_call_rate"] <= 1
    assert 0 <= summary["accuracy_before"] <= 1 and 0 <= summary["accuracy_after"] <= 1
    assert summary["eval_turns_per_episode_before"] >= 1 and "eval_tool_call_rate_after" in summary
    for key in ("tool_call_rate", "tool_error_rate", "turns_per_episode"):
        assert (tmp_path / "run" / "plots" / f"{key}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_workers_refused_for_tool_tasks():
    with pytest.raises(ValueError, match=r"workers=2: task 'arithmetic-tools' needs multi-turn rollouts.*workers=0"):
        check_tool_task(load_task("arithmetic-tools"), 2)
    check_tool_task(load_task("arithmetic"), 2)
