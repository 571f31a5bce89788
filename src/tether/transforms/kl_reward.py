"""KL reward shaping for any probabilistic ``tensordict.nn`` actor.

At construction the transform snapshots the actor's parameters and buffers (the frozen
reference ``pi_0``); on a rollout it writes ``reward - coef * (log pi(a) - log pi_0(a))``.

Departures from TorchRL: it subtracts ``coef * kl`` (TorchRL adds it, rewarding
drift); the snapshot follows ``.to(dtype / device)``; the frozen copy runs in eval mode; it is
a ``TensorDictModuleBase`` usable without TorchRL (the environment transform is in
``tether.integrations.torchrl``); missing entries raise a ``KeyError`` naming the key, and the
log-prob key is read from the actor. Why, point by point: ``docs/design.md``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import (
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModuleBase,
    TensorDictParams,
)
from tensordict.utils import NestedKey, unravel_key
from torch import nn

from tether.models.batch_io import fetch
from tether.ops.checks import kl_coefficient

__all__ = ["KLRewardTransform"]

_NEXT = "next"

_RECORD_IT = "Record it in the rollout or pass the key where it lives (in_keys for the reward)."


def _single_key(name: str, keys: Any, default: NestedKey) -> tuple[str, ...]:
    """Accepts one nested key, or a list/tuple holding exactly one, and returns it as a tuple."""
    if keys is None:
        keys = default
    if isinstance(keys, list) or (
        isinstance(keys, tuple) and keys and not all(isinstance(k, str) for k in keys)
    ):
        if len(keys) != 1:
            raise ValueError(
                f"{name} must name exactly one key; got {keys!r}. Pass a single key such as "
                f"'reward' or ('next', 'reward')."
            )
        keys = keys[0]
    try:
        key = unravel_key(keys)
    except Exception as err:  # unravel_key raises several types for malformed keys
        raise TypeError(
            f"{name} must be a string or a tuple of strings; got {keys!r}. Pass e.g. 'reward'."
        ) from err
    return key if isinstance(key, tuple) else (key,)


def _actor_keys(actor: Any) -> tuple[NestedKey, NestedKey]:
    """Returns (action key, log-prob key) as the actor declares them."""
    sample_keys = list(getattr(actor, "dist_sample_keys", []))
    if len(sample_keys) != 1:
        raise ValueError(
            f"actor must sample exactly one key; its dist_sample_keys are {sample_keys}. "
            f"Wrap an actor with a single (non-composite) action distribution."
        )
    try:
        log_prob_key = actor.log_prob_key
    except (AttributeError, RuntimeError) as err:
        raise ValueError(
            f"actor.log_prob_key could not be read ({err}). Build the actor with one sampled "
            f"key so it records a single log-probability."
        ) from err
    return unravel_key(sample_keys[0]), unravel_key(log_prob_key)


def _snapshot(actor: nn.Module, requires_grad: bool) -> tuple[nn.Module, TensorDictParams]:
    """Returns a storage-free copy of the actor and a detached clone of its tensors."""
    live = TensorDict.from_module(actor)
    # Deep-copy the actor with meta tensors swapped in: the copy owns no storage and cannot
    # alias the live weights; the frozen tensors are swapped in at call time.
    on_meta = live.apply(lambda t: torch.empty_like(t, device="meta"), filter_empty=False)
    with on_meta.to_module(actor):
        functional = copy.deepcopy(actor)
    functional.eval()

    def freeze(tensor: torch.Tensor) -> torch.Tensor:
        clone = tensor.detach().clone()
        if requires_grad and isinstance(tensor, nn.Parameter):
            return nn.Parameter(clone, requires_grad=True)
        return clone

    frozen = TensorDictParams(live.apply(freeze, filter_empty=False), no_convert=True)
    if not requires_grad:
        # to_module re-wraps a buffer placed in a parameter slot with the slot's
        # requires_grad, so the slots must not ask for gradients.
        for param in functional.parameters():
            param.requires_grad_(False)
    return functional, frozen


def _show(key: NestedKey) -> str:
    """A key as a user would write it: 'reward' or ('next', 'reward')."""
    key = unravel_key(key)
    return repr(key[0] if isinstance(key, tuple) and len(key) == 1 else key)


def _to_reward_shape(log_ratio: torch.Tensor, reward: torch.Tensor) -> torch.Tensor:
    """Aligns a ``[...]`` or ``[..., 1]`` log-ratio with a ``[...]`` or ``[..., 1]`` reward."""
    if log_ratio.shape == reward.shape:
        return log_ratio
    if reward.shape == log_ratio.shape + (1,):
        return log_ratio.unsqueeze(-1)
    if log_ratio.shape == reward.shape + (1,):
        return log_ratio.squeeze(-1)
    raise ValueError(
        f"the action log-prob has shape {tuple(log_ratio.shape)} but the reward has shape "
        f"{tuple(reward.shape)}; expected equal shapes up to a trailing 1. If the log-prob is "
        f"per action dimension, wrap the distribution in torch.distributions.Independent so it "
        f"sums over the action dimensions."
    )


class KLRewardTransform(TensorDictModuleBase):
    """Subtracts ``coef * (log pi(a) - log pi_0(a))`` from the reward of a rollout.

    Args:
        actor: a ``ProbabilisticTensorDictModule`` or ``ProbabilisticTensorDictSequential``
            with one sampled key (the action) and a ``log_prob_key`` under which rollouts
            record ``log pi(a)`` of the policy that acted. Its parameters and buffers at
            construction are the frozen reference ``pi_0``.
        coef: KL coefficient (>= 0); read/write as ``coef`` or ``kl_coef``.
        in_keys: the reward key, default ``"reward"``. It is looked up under ``"next"``
            when the tensordict has a ``"next"`` entry (TorchRL rollout layout), else at the
            root; a key that starts with ``"next"`` is taken as given.
        out_keys: where the adjusted reward goes, default the in key (overwrite), placed
            by the same rule.
        requires_grad: if True the snapshot holds differentiable ``nn.Parameter`` clones,
            registered on this module (they appear in ``parameters()``); otherwise they are
            buffers. Either way they follow ``.to(dtype / device)`` casts of this module.
        kl_key: optional key, resolved like ``out_keys``, where the log-ratio
            ``log pi(a) - log pi_0(a)`` (shaped like the reward) is also written.

    Shapes: the action log-probs are ``[*B]`` or ``[*B, 1]`` and the reward ``[*B, 1]`` or
    ``[*B]``; the outputs have the reward's shape and dtype.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import NormalParamExtractor, TensorDictModule
        >>> from tensordict.nn import ProbabilisticTensorDictModule as Prob, ProbabilisticTensorDictSequential as Seq
        >>> from tether.transforms import KLRewardTransform
        >>> net = TensorDictModule(torch.nn.Sequential(torch.nn.Linear(3, 2), NormalParamExtractor()),
        ...                        in_keys=["observation"], out_keys=["loc", "scale"])
        >>> actor = Seq(net, Prob(in_keys=["loc", "scale"], out_keys=["action"],
        ...                       distribution_class=torch.distributions.Normal, return_log_prob=True))
        >>> transform = KLRewardTransform(actor, coef=0.1)  # pi_0: the actor's weights now
        >>> td = TensorDict({"observation": torch.zeros(2, 3), "action": torch.zeros(2, 1),
        ...                  "reward": torch.ones(2, 1)}, [2])
        >>> td[transform.log_prob_key] = transform.reference_log_prob(td) + 0.5  # log pi(a) = log pi_0(a) + 0.5
        >>> transform(td)["reward"]  # 1 - 0.1 * 0.5
        tensor([[0.9500],
                [0.9500]])
    """

    def __init__(
        self,
        actor: ProbabilisticTensorDictModule | ProbabilisticTensorDictSequential,
        coef: float = 1.0,
        in_keys: Any = None,
        out_keys: Any = None,
        requires_grad: bool = False,
        *,
        kl_key: NestedKey | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(actor, nn.Module) or not callable(getattr(actor, "get_dist", None)):
            raise TypeError(
                f"actor must be a probabilistic tensordict.nn module with get_dist (e.g. "
                f"ProbabilisticTensorDictSequential); got {type(actor).__name__}. Wrap the "
                f"policy network and its distribution in ProbabilisticTensorDictSequential."
            )
        self.reward_key = _single_key("in_keys", in_keys, "reward")
        self.out_key = _single_key("out_keys", out_keys, self.reward_key)
        self.kl_key = None if kl_key is None else _single_key("kl_key", kl_key, kl_key)
        self.action_key, self.log_prob_key = _actor_keys(actor)
        self._actor_in_keys = list(actor.in_keys)
        self.kl_coef = coef
        self.requires_grad = bool(requires_grad)
        functional, self.frozen_params = _snapshot(actor, self.requires_grad)
        # Kept out of the module tree: its tensors live on the meta device and the real
        # ones are swapped in from frozen_params for each call.
        self.__dict__["_frozen_actor"] = functional
        reads = [self.reward_key, self.action_key, self.log_prob_key, *self._actor_in_keys]
        self.in_keys = list(dict.fromkeys(unravel_key(k) for k in reads))
        writes = [self.out_key] + ([self.kl_key] if self.kl_key is not None else [])
        self.out_keys = [unravel_key(k) for k in writes]

    @property
    def kl_coef(self) -> float:
        return self._coef

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        self._coef = kl_coefficient("coef", value)

    coef = kl_coef  # TorchRL's keyword, kept as an alias

    @staticmethod
    def _resolve(tensordict: TensorDictBase, key: tuple[str, ...]) -> tuple[str, ...]:
        """Places a reward-side key under "next" when the rollout has one (TorchRL layout)."""
        if key[0] == _NEXT or not isinstance(tensordict.get(_NEXT, None), TensorDictBase):
            return key
        return (_NEXT, *key)

    def reference_log_prob(self, tensordict: TensorDictBase) -> torch.Tensor:
        """``log pi_0(a)`` of the recorded actions under the frozen snapshot, shape of the log-prob."""
        action = fetch(tensordict, self.action_key, "the action", _RECORD_IT)
        keys = set(tensordict.keys(include_nested=True, leaves_only=True))
        absent = [key for key in self._actor_in_keys if unravel_key(key) not in keys]
        # The actor writes its intermediate outputs (e.g. loc/scale) into its input; a
        # selection keeps the live policy's entries in the rollout untouched. Absent inputs
        # are left for the actor to judge: a recurrent module starts from a zero hidden
        # state when none is given, so only a failure of the actor makes them required.
        inputs = tensordict.select(*[k for k in self._actor_in_keys if k not in absent])
        with self.frozen_params.to_module(self._frozen_actor):
            try:
                dist = self._frozen_actor.get_dist(inputs)
            except Exception as err:
                if not absent:
                    raise
                present = sorted(_show(k) for k in keys)
                raise KeyError(
                    f"KLRewardTransform: the actor could not run without its input(s) "
                    f"{', '.join(_show(k) for k in absent)}, missing from the rollout ({type(err).__name__}: "
                    f"{err}); Present keys: [{', '.join(present)}]. Record them in the rollout."
                ) from err
            return dist.log_prob(action)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        """Writes the KL-penalised reward (and optionally the log-ratio); returns the input."""
        reward = fetch(td, self._resolve(td, self.reward_key), "the reward", _RECORD_IT)
        current = fetch(td, self.log_prob_key, "the current policy's log-prob", _RECORD_IT)
        log_ratio = _to_reward_shape(current - self.reference_log_prob(td), reward)
        log_ratio = log_ratio.to(reward.dtype)
        td.set(self._resolve(td, self.out_key), reward - self._coef * log_ratio)
        if self.kl_key is not None:
            td.set(self._resolve(td, self.kl_key), log_ratio)
        return td

    def extra_repr(self) -> str:
        return (
            f"coef={self._coef}, reward_key={self.reward_key}, out_key={self.out_key}, "
            f"log_prob_key={self.log_prob_key}, requires_grad={self.requires_grad}"
        )
