"""Ray-backed services: remote KL transforms, a shared reference-model service, rollout workers.

Nothing here starts a Ray cluster implicitly: connect first (``start_local_cluster(num_cpus)``
for a one-node cluster bound to 127.0.0.1, or ``connect_cluster(address, timeout_s)`` /
``ray.init(address=...)``), otherwise construction, and every later call once Ray is shut
down, raises ``RayNotInitializedError``. Every wait on Ray is bounded (``ready_timeout_s``,
``timeout_s``) and fails with a ``TimeoutError`` naming what was awaited.
``tether train --workers N`` calls ``start_local_cluster`` itself unless given ``ray_address``.
"""

from tether.ray._runtime import RayNotInitializedError, connect_cluster, require_ray, start_local_cluster
from tether.ray.reference_client import PendingScore, ReferenceClient, ScoreReply, ScoreRequest
from tether.ray.reference_service import BatchLimits, ReferenceService, ServiceInfo, ServiceStats
from tether.ray.transforms import RayKLRewardTransform, RayRetrieveKL, TransformHostInfo
from tether.ray.workers import (
    RolloutPool,
    RolloutShard,
    RolloutWorker,
    SamplingSettings,
    WorkerModel,
    merge_batches,
    split_groups,
    worker_seed,
)

__all__ = [
    "BatchLimits",
    "PendingScore",
    "RayKLRewardTransform",
    "RayNotInitializedError",
    "RayRetrieveKL",
    "ReferenceClient",
    "ReferenceService",
    "RolloutPool",
    "RolloutShard",
    "RolloutWorker",
    "SamplingSettings",
    "ScoreReply",
    "ScoreRequest",
    "ServiceInfo",
    "ServiceStats",
    "TransformHostInfo",
    "WorkerModel",
    "connect_cluster",
    "merge_batches",
    "require_ray",
    "split_groups",
    "start_local_cluster",
    "worker_seed",
]
