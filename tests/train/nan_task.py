"""A test task whose reward returns NaN."""

from tests.train.bad_task import make_nan_task

TASK = make_nan_task()
