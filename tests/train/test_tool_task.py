"""``--task arithmetic-tools``: the task, a recipe step on multi-turn episodes with tool calls,
and a tiny-model smoke run of ``tether train``."""

from __future__ import annotations

import json
import math
import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import make_tokenizer
from tests.llm.naive import naive_logprobs
from tether.llm import chat_batch
from tether.models.records import StepRecord, group_ids
from tether.rollout import MultiTurnRollout
from tether.train.cli import main
from tether.train.config import TrainConfig
from tether.train.recipe import build_run, train, train_step
from tether.train.tasks import (EXAMPLE, PHRASINGS, SYSTEM_PROMPT, TASKS, Problem, ToolUse, load_task,
                                with_episode_limits)

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


def cfg(out, **kw) -> TrainConfig:
    base = dict(model="tiny", task="arithmetic-tools", steps=2, out=str(out), prompts_per_step=2, group_size=2,
                max_new_tokens=96, micro_batch_size=2, eval_size=3, eval_max_new_tokens=8, lora_rank=0,
                learning_rate=1e-3, checkpoint_every=0, threads=1, max_episode_tokens=4000)
    base.update(kw)
    return TrainConfig(**base)


def operands(question: str) -> tuple[int, int]:
    """``(a, b)`` of a question in any of the task's phrasings (the 3-digit one is ``a``)."""
    x, y = map(int, re.findall(r"\d+", question)[:2])
    return (x, y) if x >= 100 else (y, x)


def test_task_problems_and_reward():
    task = load_task("arithmetic-tools")
    assert "arithmetic-tools" in TASKS and task.tool_use == ToolUse(("calculator",), max_turns=3, max_tokens=512)
    problems = [task.train_problem(0, i, set()) for i in range(40)]
    questions = [p.chat[-1]["content"] for p in problems]
    # Each question is one of the phrasings with its operands put back in, and every phrasing occurs.
    used = {next(i for i, f in enumerate(PHRASINGS) if f.format(a=a, b=b) == q)
            for q, (a, b) in zip(questions, map(operands, questions))}
    assert used == set(range(len(PHRASINGS)))
    problem = problems[0]
    a, b = operands(questions[0])
    assert 100 <= a <= 999 and 10 <= b <= 99 and problem.answer == str(a * b) and problem.key == f"{a}*{b}"
    assert problem.chat[0] == {"role": "system", "content": SYSTEM_PROMPT} and problem.chat[1:5] == EXAMPLE
    assert task.reward(f"The answer is {a * b}.", problem) == 1.0
    assert task.reward(f"{a * b + 1}", problem) == 0.0 and task.reward(CALL % f"{a} * {b}", problem) == 0.0
    assert task.is_correct(f"{a * b:,}", problem)  # thousands separators are read as one number


class ScriptedRollout(MultiTurnRollout):
    """Multi-turn episodes whose assistant messages follow a script (``sample_turn`` overridden)."""

    def sample_turn(self, rows, limits):
        """The even rows of the first turn call the calculator, then answer with its result; the odd
        rows answer 7. With groups of two, each group holds one of each, so every group's rewards
        differ. Log-probs are the tiny model's own, so the step is on-policy for forced replies."""
        tok, model = self.policy.tokenizer, self.policy.model
        out = []
        for index, (row, limit) in enumerate(zip(rows, limits)):
            text = tok.decode(row)
            a, b = operands(text.split("<|im_start|>user")[-1])  # the question, after the worked example
            calls = text.split("<|im_start|>user")[-1].count("<|im_start|>assistant") - 1
            if index % 2 == 0 or calls:  # later turns hold only the callers
                reply = CALL % f"{a} * {b}" if calls == 0 else re.findall(r"tool\n(\d+)", text)[-1]
            else:
                reply = "7"
            ids = tok(reply)["input_ids"] + [tok.eos_token_id]
            with torch.no_grad():
                lp = naive_logprobs(model, torch.tensor(row + ids), temperature=self.policy.temperature)[len(row):]
            out.append((ids, lp.float().tolist(), True))
        return out


def scripted_rollout(run, problems, step):
    """The recipe's rollout stage (``train_step(run, step, rollout)``) over ``ScriptedRollout``."""
    use = run.task.tool_use
    episodes = ScriptedRollout(run.sampler, list(use.tools), max_turns=use.max_turns, max_tokens=use.max_tokens)
    batch = chat_batch([p.chat for p in problems], key=("history", "prompt"))
    with torch.no_grad():
        episodes(batch)
    return StepRecord.from_tensordict(batch, group_ids=group_ids(len(problems), run.cfg.group_size))


def test_recipe_step_on_scripted_tool_episodes(tmp_path):
    run = build_run(cfg(tmp_path / "run", prompts_per_step=4))
    record = train_step(run, 0, scripted_rollout)
    rate = 0.5  # one caller in each group of two
    assert record["tool_call_rate"] == rate and record["tool_calls_per_episode"] == rate
    assert record["turns_per_episode"] == 1 + rate and record["tool_error_rate"] == 0.0
    assert record["accuracy"] == rate and record["reward_mean"] == rate
    assert record["kl_per_seq"] == pytest.approx(0.0, abs=1e-4)  # policy == reference before the update
    # Advantages +-1/sqrt(2) (z-score of [1, 0] with the unbiased std): a real gradient, not rounding noise.
    assert math.isfinite(record["loss"]) and record["grad_norm"] > 1e-3


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


def test_episode_limit_flags_reach_the_rollout(tmp_path):
    """``--max-turns 1``: the first message is the last, so the scripted callers' tool calls are
    not run (end "max_turns"), no tool turn is written, and every episode has one message;
    ``--max-episode-tokens`` lands in the task's ``ToolUse`` as its ``max_tokens``."""
    seen = {}
    code = main(["train", "--model", "tiny", "--task", "arithmetic-tools", "--max-turns", "1",
                 "--max-episode-tokens", "900", "--out", str(tmp_path / "r"), "--quiet"],
                train_fn=lambda cfg, **_: seen.update(cfg=cfg) or {})
    assert code == 0 and (seen["cfg"].max_turns, seen["cfg"].max_episode_tokens) == (1, 900)
    run = build_run(cfg(tmp_path / "run", prompts_per_step=4, max_turns=1, max_episode_tokens=900))
    assert (run.task.tool_use.max_turns, run.task.tool_use.max_tokens) == (1, 900)
    record = train_step(run, 0, scripted_rollout)
    assert record["tool_call_rate"] == 0.0 and record["turns_per_episode"] == 1.0


def test_zero_keeps_the_tasks_own_limits():
    """0 keeps the task's value (3 turns, 512 tokens); a set value replaces only its own field."""
    task, tok = load_task("arithmetic-tools"), make_tokenizer()
    short = Problem(chat=[{"role": "user", "content": "What is 2 * 3?"}], answer="6", key="2*3")
    task = dataclasses.replace(task, make_problem=lambda rng: short)  # a prompt that fits 99 tokens
    limits = lambda turns, tokens, n=1: SimpleNamespace(max_turns=turns, max_episode_tokens=tokens, eval_size=n)  # noqa: E731
    assert with_episode_limits(task, limits(0, 0), tok).tool_use == task.tool_use
    assert with_episode_limits(task, limits(2, 0), tok).tool_use == ToolUse(("calculator",), 2, 512)
    assert with_episode_limits(task, limits(0, 99), tok).tool_use == ToolUse(("calculator",), 3, 99)
    assert with_episode_limits(task, limits(0, 0, n=0), tok).tool_use == task.tool_use  # --eval-size 0


@pytest.mark.parametrize("key, value, match", [
    ("max_turns", -1, r"max_turns: expected an int >= 0, got -1"),
    ("max_episode_tokens", -5, r"max_episode_tokens: expected an int >= 0, got -5"),
])
def test_episode_limits_validated(tmp_path, key, value, match):
    with pytest.raises(ValueError, match=match):
        cfg(tmp_path / "run", **{key: value}).validate()


def test_episode_limits_refused_where_they_cannot_act(tmp_path):
    with pytest.raises(ValueError, match=r"max_turns=2, max_episode_tokens=0: task 'arithmetic' is single-turn.*"
                                         r"set both to 0 or use a tool task"):
        build_run(cfg(tmp_path / "a", task="arithmetic", max_turns=2, max_episode_tokens=0))
    with pytest.raises(ValueError, match=r"max_episode_tokens: a budget of 20 tokens leaves no room to answer "
                                         r"held-out problem \d+, whose prompt renders to \d+ tokens"):
        build_run(cfg(tmp_path / "b", max_episode_tokens=20))
