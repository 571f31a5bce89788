"""A test task with a dense reward a random model can move: the share of odd code points.

A random byte-level model almost never writes a given letter, so a sparse reward would give
all-equal groups and zero advantages; this one varies from sample to sample.
"""

from tether.train.tasks import Problem, Task


def _problem(rng):
    n = rng.randint(0, 10**9)
    return Problem(chat=[{"role": "user", "content": f"say a {n % 97}"}], answer="a", key=str(n))


def _reward(response, problem):
    return sum(ord(c) % 2 for c in response) / max(len(response), 1)


TASK = Task(name="odd-share", make_problem=_problem, reward=_reward, is_correct=lambda r, p: _reward(r, p) > 0.5)
