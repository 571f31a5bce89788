"""Use tether transforms inside TorchRL environments and replay buffers (TorchRL lives apart: ``make torchrl-env``).

``as_replay_buffer_transform(MCAdvantage(...))`` returns a TorchRL ``Transform`` for a
``ReplayBuffer``: a buffer runs a transform's inverse on ``add`` / ``extend`` (where
``MCAdvantage.add`` groups trajectories and writes advantages) and its forward on
``sample`` (a no-op). A buffer given ``MCAdvantage`` unwrapped treats it as a plain
callable whose write path is the identity, so no advantage would ever be written;
``MCAdvantage.forward`` then raises instead of passing the data on.

``as_env_transform(KLRewardTransform(...))`` returns a TorchRL ``Transform`` that can be
appended to a ``TransformedEnv``: at every step it sees the root tensordict (observation,
action and the policy's log-prob at time t) together with the ``"next"`` entry holding the
reward, and writes the KL-penalised reward there.

Spec handling follows TorchRL: an adjusted reward that overwrites the env reward keeps the
reward spec's shape but becomes unbounded; an adjusted reward (or log-ratio) written to a new
key is declared as an unbounded observation entry of the reward's shape, and filled with
zeros at reset so that every step of a rollout holds the same keys.

TorchRL is imported only when ``as_env_transform`` is called.
"""

from __future__ import annotations

import functools
from typing import Any

from tensordict import TensorDictBase

__all__ = ["as_env_transform", "as_replay_buffer_transform"]

_INSTALL_HINT = (
    "tether.integrations.torchrl needs TorchRL, which tether does not install: TorchRL 0.14 pins "
    "tensordict 0.14, older than tether's own environment's. Run it in an environment of its own: "
    "`make torchrl-env` builds .venv-bench (tether, TorchRL 0.14.1 and TRL), or `pip install torchrl` "
    "in a fresh venv next to `pip install -e .`."
)


def _import_torchrl() -> tuple[type, type]:
    try:
        from torchrl.data.tensor_specs import Unbounded
        from torchrl.envs.transforms.transforms import Transform
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err
    return Transform, Unbounded


@functools.lru_cache(maxsize=1)
def _env_transform_class() -> type:
    """Builds the TorchRL ``Transform`` subclass once TorchRL is importable (one class per process)."""
    Transform, _ = _import_torchrl()

    class KLRewardEnvTransform(Transform):
        """TorchRL ``Transform`` adapter around a :class:`tether.transforms.KLRewardTransform`."""

        def __init__(self, kl_transform: Any) -> None:
            super().__init__(in_keys=[kl_transform.reward_key], out_keys=[kl_transform.out_key])
            # A submodule, so env.to(...) moves the frozen snapshot along with the env.
            self.kl_transform = kl_transform

        def _new_keys(self) -> list:
            keys = [self.kl_transform.out_key, self.kl_transform.kl_key]
            return [k for k in keys if k is not None and k != self.kl_transform.reward_key]

        def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase):
            # The KL needs time-t entries (action, its log-prob, the observation the policy
            # saw), so the adapter assembles the usual rollout layout: root + "next".
            root = tensordict.exclude("next")
            root.set("next", next_tensordict)
            return self.kl_transform(root).get("next")

        def _call(self, tensordict: TensorDictBase) -> TensorDictBase:
            return self.kl_transform(tensordict)

        def forward(self, td: TensorDictBase) -> TensorDictBase:
            return self.kl_transform(td)

        def _reset(self, tensordict: TensorDictBase, tensordict_reset: TensorDictBase):
            # New keys are observation entries; a reset has no transition to penalise, so
            # they start at 0, shaped like the reward.
            new_keys = self._new_keys()
            if new_keys and self.parent is not None:
                zero = self.parent.full_reward_spec[self.parent.reward_key].zero()
                for key in new_keys:
                    if tensordict_reset.get(key, None) is None:
                        tensordict_reset.set(key, zero.clone())
            return tensordict_reset

        def transform_output_spec(self, output_spec):
            return _kl_output_spec(self.kl_transform, self._new_keys(), output_spec)

    return KLRewardEnvTransform


def _kl_output_spec(kl_transform: Any, new_keys: list, output_spec: Any) -> Any:
    """The env's output spec with the KL transform's reward made unbounded and its new keys as observations."""
    _, Unbounded = _import_torchrl()
    reward_key = kl_transform.reward_key
    reward_spec = output_spec["full_reward_spec"].get(reward_key, None)
    if reward_spec is None:
        raise KeyError(
            f"in_keys {reward_key!r} of the KL transform is not a reward of the "
            f"environment; its rewards are "
            f"{list(output_spec['full_reward_spec'].keys(True, True))}. Pass one of "
            f"them as in_keys."
        )
    unbounded = Unbounded(
        shape=reward_spec.shape, device=reward_spec.device, dtype=reward_spec.dtype
    )
    if kl_transform.out_key == reward_key:
        output_spec["full_reward_spec"][reward_key] = unbounded
    for key in new_keys:
        output_spec["full_observation_spec"][key] = unbounded.clone()
    return output_spec


def as_env_transform(transform: Any) -> Any:
    """Wraps a :class:`tether.transforms.KLRewardTransform` as a TorchRL env ``Transform``.

    Example::

        env = TransformedEnv(GymEnv("Pendulum-v1"), as_env_transform(
            KLRewardTransform(actor, coef=0.1, out_keys="reward_kl")))
        td = env.rollout(3, actor)  # td["next", "reward_kl"] holds the penalised reward

    Raises:
        ImportError: if TorchRL is not installed.
        TypeError: if ``transform`` is not a ``KLRewardTransform``.
    """
    from tether.transforms import KLRewardTransform

    if not isinstance(transform, KLRewardTransform):
        raise TypeError(
            f"transform must be a tether.transforms.KLRewardTransform; got "
            f"{type(transform).__name__}. Build one with KLRewardTransform(actor, ...)."
        )
    return _env_transform_class()(transform)


@functools.lru_cache(maxsize=1)
def _buffer_transform_class() -> type:
    """Builds the TorchRL ``Transform`` subclass for replay buffers (one class per process)."""
    Transform, _ = _import_torchrl()

    class MCAdvantageBufferTransform(Transform):
        """TorchRL ``Transform`` adapter: the buffer's write path runs ``MCAdvantage.add``."""

        def __init__(self, advantage: Any) -> None:
            super().__init__(in_keys=list(advantage.in_keys), out_keys=list(advantage.out_keys))
            self.advantage = advantage

        # Writing to the buffer queues trajectories (and emits completed groups); reading a
        # sample back only checks that its advantages are there.
        def _inv_call(self, written: TensorDictBase) -> TensorDictBase | None:
            return self.advantage.add(written)

        def _call(self, sampled: TensorDictBase) -> TensorDictBase:
            return self.advantage(sampled)

        forward = _call

    return MCAdvantageBufferTransform


def as_replay_buffer_transform(advantage: Any) -> Any:
    """Wraps a :class:`tether.objectives.MCAdvantage` as a TorchRL replay-buffer ``Transform``.

    Example::

        rb = ReplayBuffer(storage=LazyStackStorage(64),
                          transform=as_replay_buffer_transform(MCAdvantage(grpo_size=4)))
        rb.extend(trajectory)  # queued; a completed group is written with its advantages

    Raises:
        ImportError: if TorchRL is not installed.
        TypeError: if ``advantage`` is not an ``MCAdvantage``.
    """
    from tether.objectives import MCAdvantage

    if not isinstance(advantage, MCAdvantage):
        raise TypeError(
            f"advantage must be a tether.objectives.MCAdvantage; got {type(advantage).__name__}. "
            "Build one with MCAdvantage(grpo_size=...)."
        )
    return _buffer_transform_class()(advantage)
