"""The local Ray cluster of the Ray tests: 2 CPUs on 127.0.0.1, no dashboard, one per session.

One cluster for the whole session, since starting one costs seconds on a small machine; every
test kills the actors it started, so the next one finds the CPUs free. Modules that start
their own cluster (test_cli.py, in a subprocess) do not use this fixture.
"""

from __future__ import annotations

import pytest
import ray

from tether.ray import start_local_cluster


@pytest.fixture(scope="session")
def ray_cluster():
    """Start the local cluster tether's own recipe would start, and shut it down at the end."""
    start_local_cluster(2)
    yield ray.cluster_resources()
    ray.shutdown()
