"""The forgetting axis: the chat prompts file, the rule checks on hand-written answers, the chat KL
through ``sampled_kl`` (0 for the reference itself, the naive exact KL for moved weights) and the
capability's greedy answers checked one by one against a naive per-prompt decode (tiny model)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.train.test_heldout_kl import _naive
from tests.train.test_kl_budget import _moved_away
from tests.train.test_recipe import tiny_cfg
from tether.models import TransformersWrapper
from tether.train import forgetting
from tether.train.forgetting import RULES, Rule, capability, chat_problems, chat_prompts, instruction_problems, measure
from tether.train.recipe import build_run
from tether.train.tasks import prompt_batch


def test_the_chat_prompts_are_a_few_hundred_distinct_prompts_without_arithmetic():
    prompts = chat_prompts()
    assert 200 <= len(prompts) == len(set(prompts))
    assert not [p for p in prompts if re.search(r"\d|[+*/=]", p)]
    assert chat_prompts(5) == prompts[:5]
    with pytest.raises(ValueError, match=r"n: expected 1\.\.\d+ chat prompts"):
        chat_prompts(0)
    with pytest.raises(ValueError, match="n: expected"):
        chat_prompts(len(prompts) + 1)


@pytest.mark.parametrize(("rule", "answer", "passes"), [
    ("bullets", "- rest\n- water\n- sleep", True),
    ("bullets", "Here you go:\n1. Rest well.\n2) Drink water.", True),
    ("bullets", "\u2022 one\nplain line\n* two", True),
    ("bullets", "1. Only one numbered line, then prose.", False),
    ("bullets", "-no space after the dash\n-again", False),
    ("bullets", "In 1990. Then 2000. Both dates.", False),
    ("yes-or-no", "Yes, it is.", True),
    ("yes-or-no", "  no. Never.", True),
    ("yes-or-no", "Yesterday it rained.", False),
    ("yes-or-no", "Well, yes.", False),
    ("yes-or-no", "", False),
])
def test_each_rule_checks_what_its_instruction_asks(rule, answer, passes):
    assert RULES[rule].check(answer) is passes


def test_instructions_cycle_over_the_rules_and_an_unknown_rule_is_named():
    items = instruction_problems(["A?", "B?", "C?"], ["bullets", "yes-or-no"])
    assert [name for name, _ in items] == ["bullets", "yes-or-no", "bullets"]
    assert items[1][1].chat == [{"role": "user", "content": "Start your answer with Yes or No. B?"}]
    with pytest.raises(ValueError, match=r"rules: expected a non-empty list of names from \['bullets', 'yes-or-no'\]"):
        instruction_problems(["A?"], ["uppercase"])
    with pytest.raises(ValueError, match="rules"):
        instruction_problems(["A?"], [])


def test_capability_checks_each_greedy_answer_as_a_naive_one_prompt_decode_does(tmp_path, monkeypatch):
    """A rule the tiny model's random bytes pass about half the time (an even number of characters):
    the batched, padded greedy answers give the same verdicts as each prompt decoded alone."""
    monkeypatch.setitem(RULES, "even", Rule("Answer.", lambda a: len(a) % 2 == 0))
    run = build_run(tiny_cfg(tmp_path / "run"))
    items = instruction_problems(chat_prompts(7), ["even"])
    got = capability(run.models.policy, run.models.tokenizer, items, max_new_tokens=5, batch_rows=3)
    alone = TransformersWrapper(run.models.policy, run.models.tokenizer, input_mode="history", generate=True,
                                generate_kwargs={"max_new_tokens": 5, "do_sample": False})
    naive = [len(alone(prompt_batch([p], "chat")).get(("text", "response")).tolist()[0]) % 2 == 0 for _, p in items]
    assert got == naive and 0 < sum(got) < len(got)  # both verdicts occur: the comparison is not vacuous


def test_the_chat_kl_is_zero_for_the_reference_and_the_naive_exact_kl_for_moved_weights(tmp_path):
    """float64 tiny model: the untrained policy reads 0 on its own samples; moved weights read the
    naive full-logit KL of the answers the same seed draws for the chat prompts (1e-7, as in
    test_heldout_kl); each rule's share is over its own prompts."""
    run = build_run(tiny_cfg(tmp_path / "run", dtype="float64"))
    models = run.models
    still = measure(models.policy, models.reference, models.tokenizer, run.task, prompts=4, max_new_tokens=5, seed=2)
    assert still.kl_sampled_per_seq == 0.0 and still.prompts == 4
    _moved_away(run, sigma=0.05)
    moved = measure(models.policy, models.reference, models.tokenizer, run.task, prompts=4, max_new_tokens=5, seed=2)
    draw = TransformersWrapper(models.policy, models.tokenizer, input_mode="history", generate=True,
                               generate_kwargs={"max_new_tokens": 5, "generator": torch.Generator().manual_seed(2)})
    td = draw(prompt_batch(chat_problems(chat_prompts(4)), "chat"))
    assert moved.kl_sampled_per_seq == pytest.approx(float(_naive(run, td, 1.0).mean()), rel=1e-7)
    assert moved.kl_sampled_per_seq > 0
    assert set(moved.capability_per_rule) == set(RULES)
    assert moved.capability_rate == pytest.approx(sum(moved.capability_per_rule.values()) / len(RULES))
    assert forgetting.CHAT_PROMPTS.is_file()
