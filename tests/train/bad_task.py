"""A test task whose reward breaks on purpose: it raises for answers containing 'b', else NaN."""

import math

from tether.train.tasks import Problem, Task


def _problem(rng):
    n = rng.randint(0, 10**9)
    return Problem(chat=[{"role": "user", "content": f"q{n % 89}"}], answer="x", key=str(n))


def _reward(response, problem):
    if problem.answer == "x" and len(response) >= 0:
        raise ZeroDivisionError("broken reward")
    return math.nan


TASK = Task(name="broken", make_problem=_problem, reward=_reward, is_correct=lambda r, p: False)


def make_nan_task():
    return Task(name="nan", make_problem=_problem, reward=lambda r, p: math.nan, is_correct=lambda r, p: False)
