"""``--reward-funcs`` / ``--reward-weights`` / ``--reward-model``: TRL's calling convention, None,
weights, per-function logging, every fault named, and runs on the tiny model."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import make_tiny_classifier, make_tokenizer, unloadable_model
from tests.train.test_data import ROWS, write_jsonl
from tests.train.test_recipe import tiny_cfg
from tether.models import SequenceRewardModel
from tether.train.cli import main
from tether.train.recipe import RewardError, build_run, sample, add_rewards, step_problems, train
from tether.train.rewards import (FunctionReward, RewardFunction, RewardModelFunction, Samples, load_reward_funcs,
                                  parse_weights)
from tether.train.tasks import Problem

PROBLEMS = [Problem(chat=[{"role": "user", "content": f"q{i}"}], answer="", key=str(i),
                    columns={"answer": f"a{i}", "level": i}, text=f"q{i}") for i in range(3)]
SAMPLES = Samples(PROBLEMS, ["x a0", "y", "boom"], [[1, 2], [3], [4, 5, 6]])


def reward(*fns, weights=None, prompt_format="text") -> FunctionReward:
    funcs = [RewardFunction(f.__name__, f, "test file") for f in fns]
    return FunctionReward(funcs, weights or [1.0] * len(funcs), prompt_format)


def test_weighted_sum_skips_none_and_each_function_is_kept():
    """f = [1, None, 0.5], g = [None, 2, 1], weights (2, 0.5): totals [2*1, 0.5*2, 2*0.5 + 0.5*1] = [2, 1, 1.5]."""
    def f(prompts, completions, **kw):
        return [1, None, 0.5]

    def g(prompts, completions, **kw):
        return [None, 2.0, True]

    out = reward(f, g, weights=[2.0, 0.5])(SAMPLES, "step 1")
    assert out.total.tolist() == [2.0, 1.0, 1.5] and out.total.dtype == torch.float32
    assert out.per_function["f"].tolist()[::2] == [1.0, 0.5] and math.isnan(out.per_function["f"][1])
    assert out.correct is None


@pytest.mark.parametrize("prompt_format", ["chat", "text"])
def test_functions_get_trl_arguments_by_keyword(prompt_format):
    seen = {}

    def record(prompts, completions, completion_ids, answer, level, **kw):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, answer=answer, level=level, kw=kw)
        return [0.0, 1.0, 0.0]

    reward(record, prompt_format=prompt_format)(SAMPLES, "step 1")
    if prompt_format == "chat":
        assert seen["prompts"] == [p.chat for p in PROBLEMS]
        assert seen["completions"][0] == [{"role": "assistant", "content": "x a0"}]
    else:
        assert seen["prompts"] == ["q0", "q1", "q2"] and seen["completions"] == SAMPLES.completions
    assert seen["ids"] == [[1, 2], [3], [4, 5, 6]] and seen["answer"] == ["a0", "a1", "a2"]
    assert seen["level"] == [0, 1, 2] and seen["kw"] == {}


def test_a_sample_no_function_applies_to_is_an_error():
    def f(prompts, completions, **kw):
        return [1.0, None, 0.0]

    with pytest.raises(RewardError, match=r"every reward function \(f\) returned None for sample 1 \(prompt 'q1', "
                                          r"completion 'y'\) at step 4"):
        reward(f)(SAMPLES, "step 4")


def test_a_raising_function_names_itself_and_the_sample_that_breaks_it():
    def picky(prompts, completions, **kw):
        return [1.0 / (c != "boom") for c in completions]

    with pytest.raises(RewardError, match=r"reward function picky \(test file\) raised ZeroDivisionError: .* at step 2 on "
                                          r"sample 2 \(prompt 'q2', completion 'boom'\)"):
        reward(picky)(SAMPLES, "step 2")


@pytest.mark.parametrize("value,match", [
    ([1.0, 2.0], r"returned 2 values for 3 samples"),
    (0.5, r"returned float 0.5, expected a list of 3 floats or None"),
    ("111", r"returned str '111', expected a list"),
    ([1.0, "2", 0.0], r"returned str '2' for sample 1 \(prompt 'q1', completion 'y'\), expected a float or None"),
    ([1.0, 0.0, math.nan], r"returned nan for sample 2 .* rewards must be finite"),
    ([-math.inf, 0.0, 0.0], r"returned -inf for sample 0 "),
])
def test_wrong_returns_name_the_function_and_sample(value, match):
    def bad(prompts, completions, **kw):
        return value

    with pytest.raises(RewardError, match=r"reward function bad \(test file\) at step 1 " + match):
        reward(bad)(SAMPLES, "step 1")


def test_a_function_that_cannot_take_the_columns_is_told_to_add_kwargs():
    def narrow(prompts, completions):
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"narrow \(test file\) cannot take the arguments \['answer', 'completion_ids', "
                                          r"'completions', 'level', 'prompts'\] by keyword .* give it a \*\*kwargs"):
        reward(narrow)(SAMPLES, "step 1")


def test_a_function_needing_a_column_the_dataset_lacks_is_told_which():
    def wants(prompts, completions, solution, **kw):
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"wants \(test file\) needs \['solution'\], which the batch does not have "
                                          r"\(its arguments: \['answer', 'completion_ids', 'completions', 'level', 'prompts'\]\)"):
        reward(wants)(SAMPLES, "step 1")


def test_columns_named_like_the_arguments_are_refused():
    problems = [Problem(chat=[{"role": "user", "content": "q"}], answer="", key="0", columns={"completions": 1})]
    with pytest.raises(RewardError, match=r"dataset columns \['completions'\] have the names"):
        reward(lambda **kw: [0.0])(Samples(problems, ["c"], [[1]]), "step 1")


# ------------------------------------------------------------------ async reward functions
def test_async_functions_run_concurrently_and_weigh_like_sync_ones():
    """``ping`` waits for ``pong``'s event and ``pong`` for ``ping``'s: run one after the other,
    each would wait forever (the 5 s guard turns that into a failure); together both finish.
    Values: ping [1, 2, 3], pong [None, 1, 1], sync s [0.5] * 3, weights (1, 2, 4):
    totals [1 + 2, 2 + 2 + 2, 3 + 2 + 2] = [3, 6, 7]."""
    events = {}

    def event(name):
        return events.setdefault(name, asyncio.Event())

    async def ping(prompts, completions, **kw):
        event("ping").set()
        await asyncio.wait_for(event("pong").wait(), 5)
        return [1.0, 2.0, 3.0]

    async def pong(prompts, completions, **kw):
        event("pong").set()
        await asyncio.wait_for(event("ping").wait(), 5)
        return [None, 1.0, 1.0]

    def s(prompts, completions, **kw):
        return [0.5] * len(completions)

    out = reward(ping, pong, s, weights=[1.0, 2.0, 4.0])(SAMPLES, "step 1")
    assert out.total.tolist() == [3.0, 6.0, 7.0]
    assert out.per_function["ping"].tolist() == [1.0, 2.0, 3.0]


def test_an_async_function_inside_a_running_event_loop():
    """A notebook's cell runs inside an event loop; the functions then run on a thread's own loop."""
    async def twice(prompts, completions, **kw):
        await asyncio.sleep(0)
        return [2.0 * len(c) for c in completions]

    async def main():
        return reward(twice)(SAMPLES, "step 1")

    assert asyncio.run(main()).total.tolist() == [8.0, 2.0, 8.0]  # 2 x len("x a0", "y", "boom")


def test_a_raising_async_function_names_itself_and_the_sample():
    async def picky(prompts, completions, **kw):
        await asyncio.sleep(0)
        return [1.0 / (c != "boom") for c in completions]

    with pytest.raises(RewardError, match=r"reward function picky \(test file\) raised ZeroDivisionError: .* at step 3 "
                                          r"on sample 2 \(prompt 'q2', completion 'boom'\)"):
        reward(picky)(SAMPLES, "step 3")


def test_an_async_function_returning_too_few_values_is_named():
    async def short(prompts, completions, **kw):
        return [1.0]

    with pytest.raises(RewardError, match=r"reward function short \(test file\) at step 1 returned 1 values for 3 "
                                          r"samples"):
        reward(short)(SAMPLES, "step 1")


def test_an_async_function_in_a_file_is_found(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("async def judge(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    (func,) = load_reward_funcs(str(path))
    assert func.name == "judge" and reward(func.fn)(SAMPLES, "step 1").total.tolist() == [1.0, 1.0, 1.0]


def test_which_functions_a_file_gives(tmp_path):
    """Public functions defined in the file, in order; imports and _helpers left out; REWARD_FUNCS wins."""
    path = tmp_path / "r.py"
    path.write_text("from math import sqrt\n\ndef _helper(x):\n    return x\n\n"
                    "def zeta(prompts, completions, **kw):\n    return [0.0] * len(completions)\n\n"
                    "def alpha(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    assert [f.name for f in load_reward_funcs(str(path))] == ["zeta", "alpha"]
    path.write_text(path.read_text() + "\nREWARD_FUNCS = [alpha]\n")
    assert [(f.name, f.origin) for f in load_reward_funcs(str(path))] == [("alpha", str(path))]


@pytest.mark.parametrize("source,match", [
    ("raise RuntimeError('no GPU here')\n", r"reward_funcs: running .*r.py raised RuntimeError: no GPU here; fix the file"),
    ("def f(:\n", r"reward_funcs: running .*r.py raised SyntaxError"),
    ("X = 1\n", r"reward_funcs: .*r.py defines no reward function"),
    ("REWARD_FUNCS = ['f']\n", r"defines no reward function .* got \['f'\]"),
])
def test_bad_reward_files_are_named(tmp_path, source, match):
    (tmp_path / "r.py").write_text(source)
    with pytest.raises(ValueError, match=match):
        load_reward_funcs(str(tmp_path / "r.py"))


def test_weights_parse_or_are_refused():
    assert parse_weights("", ["a", "b"]) == [1.0, 1.0]
    assert parse_weights(" 0.2, 1 ", ["a", "b"]) == [0.2, 1.0]
    with pytest.raises(ValueError, match=r"reward_weights: expected 2 finite numbers, one for each of \['a', 'b'\]"):
        parse_weights("1", ["a", "b"])
    with pytest.raises(ValueError, match=r"expected 1 finite numbers"):
        parse_weights("nan", ["a"])
    with pytest.raises(ValueError, match=r"expected comma-separated numbers, got 'x'"):
        parse_weights("x", ["a"])


# ------------------------------------------------------------------------------ reward model
def save_reward_model(path: Path) -> str:
    make_tiny_classifier(pad_token_id=259, seed=3).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("prompt_format", ["chat", "text"])
def test_reward_model_scores_the_rendered_conversation(tmp_path, prompt_format):
    """The end score of prompt + completion: chat template of the reward model's tokenizer, or the strings joined."""
    path = save_reward_model(tmp_path / "rm")
    fn = RewardModelFunction(path, prompt_format, torch.device("cpu"))
    if prompt_format == "chat":
        prompts, completions = [p.chat for p in PROBLEMS], [[{"role": "assistant", "content": c}] for c in SAMPLES.completions]
        texts = [f"<|im_start|>user\n{p.chat[0]['content']}<|im_end|>\n<|im_start|>assistant\n{c}<|im_end|>\n"
                 for p, c in zip(PROBLEMS, SAMPLES.completions)]
    else:
        prompts, completions = [p.text for p in PROBLEMS], SAMPLES.completions
        texts = [p.text + c for p, c in zip(PROBLEMS, SAMPLES.completions)]
    reference = SequenceRewardModel(make_tiny_classifier(pad_token_id=259, seed=3), make_tokenizer())
    expected = torch.cat([reference.score_texts([t]).end_scores for t in texts])  # one at a time: no padding
    assert fn.__name__ == "rm"
    torch.testing.assert_close(torch.tensor(fn(prompts=prompts, completions=completions)), expected, rtol=1e-5, atol=1e-6)


def test_reward_model_without_a_chat_template_is_refused_for_chat_prompts(tmp_path):
    path = tmp_path / "rm"
    make_tiny_classifier(pad_token_id=259).save_pretrained(path)
    make_tokenizer(chat_template=None).save_pretrained(path)
    with pytest.raises(ValueError, match=r"reward_model: .*rm's tokenizer has no chat template"):
        RewardModelFunction(str(path), "chat", torch.device("cpu"))


# ------------------------------------------------------------------------------ runs on the tiny model
REWARDS = '''
def odd_share(prompts, completions, **kw):
    return [sum(ord(ch) % 2 for ch in c) / max(len(c), 1) for c in completions]

def level_bonus(prompts, completions, level, **kw):
    return [None if lv == 0 else 0.5 * lv for lv in level]
'''


def run_cfg(tmp_path: Path, **kw):
    (tmp_path / "r.py").write_text(kw.pop("rewards", REWARDS))
    base = dict(task="arithmetic", dataset=write_jsonl(tmp_path / "d.jsonl", ROWS), reward_funcs=str(tmp_path / "r.py"),
                prompt_format="text", eval_split=0.2)
    base.update(kw)
    return tiny_cfg(tmp_path / "run", **base)


def test_logged_rewards_are_the_functions_values(tmp_path):
    """On a real rollout: the total is 1*odd_share + 3*level_bonus where level_bonus applies, and each
    function's logged value is its mean where it applies."""
    run = build_run(run_cfg(tmp_path, reward_weights="1,3"))
    problems = step_problems(run, 0)
    record = sample(run, problems, 0)
    out = add_rewards(run, record, problems, 0)
    completions = record.responses
    odd = torch.tensor([sum(ord(ch) % 2 for ch in c) / max(len(c), 1) for c in completions], dtype=torch.float64)
    level = torch.tensor([0.5 * p.columns["level"] for p in problems], dtype=torch.float64)
    torch.testing.assert_close(out.total.double(), odd + 3 * level, rtol=1e-6, atol=1e-7)
    assert [math.isnan(v) for v in out.per_function["level_bonus"].tolist()] == [p.columns["level"] == 0 for p in problems]


def test_a_reward_run_logs_each_function_by_name(tmp_path):
    summary = train(run_cfg(tmp_path, steps=2), progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all({"reward/odd_share", "reward/level_bonus"} <= r.keys() for r in records)
    assert summary["eval_size"] == 2 and {"reward/odd_share_before", "reward/odd_share_after"} <= summary.keys()


def test_reward_funcs_replace_a_tasks_reward_and_keep_its_accuracy(tmp_path):
    """With the built-in arithmetic task, the functions get its ``answer`` column; accuracy stays the task's."""
    rewards = "def knows(prompts, completions, answer, **kw):\n    return [float(a in c) for c, a in zip(completions, answer)]\n"
    (tmp_path / "r.py").write_text(rewards)
    run = build_run(tiny_cfg(tmp_path / "run", task="arithmetic", reward_funcs=str(tmp_path / "r.py")))
    problems = step_problems(run, 0)
    record = sample(run, problems, 0)
    out = add_rewards(run, record, problems, 0)
    completions = record.responses
    assert out.total.tolist() == [float(p.answer in c) for c, p in zip(completions, problems)]
    assert out.correct is not None and out.correct.shape == (len(problems),)


def test_a_failing_reward_leaves_a_run_that_resumes(tmp_path):
    """A function that raises at step 2 names itself and the sample and the checkpoint of step 1;
    with the file fixed, ``--resume`` finishes the run."""
    broken = REWARDS + "\ncalls = []\n\ndef flaky(prompts, completions, **kw):\n    calls.append(1)\n" \
                       "    if len(calls) == 3:\n        raise KeyError('gone')\n    return [0.0] * len(completions)\n"
    cfg = run_cfg(tmp_path, rewards=broken)  # call 1: evaluation before training, 2: step 1, 3: step 2
    with pytest.raises(RewardError, match=r"reward function flaky \(.*r.py\) raised KeyError: 'gone' at step 2 on the batch "
                                          r"of 6 samples \(no sample alone fails\).*holds the checkpoints of steps 1;"):
        train(cfg, progress=False)
    run = tmp_path / "run"
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    (tmp_path / "r.py").write_text(broken.replace("len(calls) == 3", "False"))
    assert train(cfg, resume=True, progress=False)["steps"] == 3


@pytest.mark.parametrize("source,match", [
    ("def wants(prompts, completions, solution, **kw):\n    return [0.0] * len(completions)\n",
     r"reward function wants \(.*r.py\) needs \['solution'\], which dataset d.jsonl does not have \(its arguments: "
     r"\['answer', 'completion_ids', 'completions', 'level', 'prompts'\]\); add those columns"),
    ("def narrow(prompts, completions):\n    return [0.0] * len(completions)\n",
     r"reward function narrow \(.*r.py\) cannot take the arguments \['answer', .*\] by keyword .*\*\*kwargs"),
], ids=["missing-column", "no-kwargs"])
def test_a_reward_function_the_dataset_cannot_call_fails_before_the_model_loads(tmp_path, capsys,
                                                                              source, match):
    """A function needing a column the dataset lacks (or taking no **kwargs beside its columns) is
    refused by `tether train` in one line (exit 2) before any model is built, and the run
    directory is never created; the reward file ran once."""
    import re

    cfg = run_cfg(tmp_path, rewards="print('reward file ran')\n" + source, model=unloadable_model(tmp_path / "model"))
    with pytest.raises(RewardError, match=match):
        train(cfg, progress=False)
    assert not (tmp_path / "run").exists()
    capsys.readouterr()
    assert main(["train", "--quiet", *[f"{k}={v}" for k, v in cfg.__dict__.items()]]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and re.match(r"tether train: " + match, lines[0]), out.err
    assert out.out.count("reward file ran") == 1 and not (tmp_path / "run").exists()


def test_a_reward_model_run(tmp_path):
    cfg = run_cfg(tmp_path, steps=1, reward_model=save_reward_model(tmp_path / "my-rm"), reward_weights="1,0,0.5")
    train(cfg, progress=False)
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert {"reward/odd_share", "reward/level_bonus", "reward/my-rm"} <= record.keys()


def test_eval_of_a_run_with_reward_funcs_needs_trust(tmp_path, capsys):
    cfg = run_cfg(tmp_path, steps=1)
    train(cfg, progress=False)
    assert main(["eval", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"names the task or reward file {tmp_path / 'r.py'}" in err and "Pass --trust-task-code" in err
    assert main(["eval", str(tmp_path / "run"), "--trust-task-code"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 2 and result["accuracy"] is None and set(result["rewards"]) == {"odd_share", "level_bonus"}


def test_a_task_file_that_raises_is_named_like_a_reward_file(tmp_path):
    from tether.train.tasks import load_task

    (tmp_path / "t.py").write_text("import no_such_module\n")
    with pytest.raises(ValueError, match=r"task: running .*t.py raised ModuleNotFoundError: No module named 'no_such_module'"):
        load_task(str(tmp_path / "t.py"))
