"""The Ray pieces' docstring examples, on the session's local cluster (tests/ray/conftest.py):
each starts one actor, compares it with the in-process piece, and shuts it down."""

from __future__ import annotations

import pytest

from tests.docstring_examples import run_examples

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("dotted", ["tether.ray.RayKLRewardTransform", "tether.ray.RayRetrieveKL",
                                    "tether.ray.ReferenceService"])
def test_ray_docstring_examples_run(ray_cluster, dotted):
    run_examples(dotted)
