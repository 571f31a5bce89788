"""Best-of-n: the analytic KL of picking the best of n draws, the pick on hand-built answers, and
the sampled answers scored by the task (tiny model, the count task)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.train.test_recipe import tiny_cfg
from tether.train.best_of_n import best_of_n_correct, best_of_n_kl, sample_scored
from tether.train.recipe import build_run


def test_the_kl_of_one_draw_is_zero_and_of_two_is_log2_minus_a_half():
    """Best of n under a continuous reward: the drawn answer's quantile u has density n u^(n-1),
    so KL = E[log(n u^(n-1))] = log n + (n-1) E[log u] = log n - (n-1)/n (E[log u] = -1/n under
    that density). n = 1: 0; n = 2: log 2 - 1/2 = 0.19314718...; it grows like log n."""
    assert best_of_n_kl(1) == 0.0
    assert best_of_n_kl(2) == pytest.approx(0.1931471805599453, abs=1e-15)
    assert best_of_n_kl(32) == pytest.approx(math.log(32) - 31 / 32, abs=1e-15)
    kls = [best_of_n_kl(n) for n in range(1, 40)]
    assert all(a < b for a, b in zip(kls, kls[1:])) and all(kl < math.log(n) for n, kl in zip(range(2, 40), kls[1:]))


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "4"])
def test_the_kl_refuses_what_is_no_count_of_draws(bad):
    with pytest.raises(ValueError, match="n: expected an integer >= 1"):
        best_of_n_kl(bad)


def test_the_best_of_the_first_n_by_reward_and_a_tie_counts_when_any_tied_answer_is_right():
    """Four problems, four answers each, in draw order:
    - row 0: the right answer (1.1) comes third: wrong for n <= 2, right from n = 3;
    - row 1: a wrong answer scores highest (a reward that disagrees with correctness): never right;
    - row 2: two answers tie at 0.5, the second right: right from n = 2, wrong at n = 1;
    - row 3: every answer right: right at every n."""
    rewards = torch.tensor([[0.0, 0.1, 1.1, 0.0],
                            [0.9, 0.2, 0.5, 0.1],
                            [0.5, 0.5, 0.0, 0.0],
                            [1.0, 1.0, 1.1, 1.0]], dtype=torch.float64)
    correct = torch.tensor([[0, 0, 1, 0],
                            [0, 1, 1, 0],
                            [0, 1, 0, 0],
                            [1, 1, 1, 1]], dtype=torch.bool)
    got = {n: best_of_n_correct(rewards, correct, n).tolist() for n in (1, 2, 3, 4)}
    assert got == {1: [False, False, False, True], 2: [False, False, True, True],
                   3: [True, False, True, True], 4: [True, False, True, True]}


def test_the_pick_refuses_mismatched_shapes_and_an_n_beyond_the_draws():
    rewards, correct = torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"n: expected 1..4"):
        best_of_n_correct(rewards, correct, 5)
    with pytest.raises(ValueError, match="rewards, correct"):
        best_of_n_correct(rewards, correct[:, :3], 2)


def test_sampled_answers_are_scored_by_the_task_in_problem_major_order(tmp_path):
    """Three problems x 4 draws of the tiny policy: each [P, m] entry is the task's own reward and
    correctness (the reward kept in float32, as the recipe's) of the answer the same seeded draw
    gives when the rows, repeated problem by problem, are sampled in one batch."""
    from tether.models import TransformersWrapper
    from tether.train.rewards import samples_from_batch
    from tether.train.tasks import prompt_batch

    run = build_run(tiny_cfg(tmp_path / "run", eval_size=3))
    problems = run.held_out
    rewards, correct = sample_scored(run.models.policy, run.models.tokenizer, run.task, problems, samples=4,
                                     max_new_tokens=6, temperature=1.0, seed=3, batch_rows=12)
    assert rewards.shape == correct.shape == (3, 4) and rewards.dtype == torch.float64
    rows = [p for p in problems for _ in range(4)]
    draw = TransformersWrapper(run.models.policy, run.models.tokenizer, input_mode="history", generate=True,
                               generate_kwargs={"max_new_tokens": 6, "generator": torch.Generator().manual_seed(3)})
    answers = samples_from_batch(draw(prompt_batch(rows, "chat")), rows).completions
    expected = torch.tensor([run.task.reward(a, p) for a, p in zip(answers, rows)], dtype=torch.float32).double().view(3, 4)
    assert torch.equal(rewards, expected)
    assert correct.view(-1).tolist() == [bool(run.task.is_correct(a, p)) for a, p in zip(answers, rows)]
    with pytest.raises(ValueError, match="samples, problems"):
        sample_scored(run.models.policy, run.models.tokenizer, run.task, [], samples=4, max_new_tokens=6,
                      temperature=1.0, seed=3)
