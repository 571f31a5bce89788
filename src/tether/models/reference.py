"""Reference models for the KL leash, and the policy for moving them during training.

Three ways to hold the reference:

- ``frozen_copy(model)``: an independent deep copy, frozen and in eval mode, optionally on
  its own device or in its own dtype (e.g. a bfloat16 reference beside a float32 policy).
- ``adapter_disabled(policy)``: for a PEFT (LoRA and relatives) policy, the reference is the
  policy itself run with its adapter switched off, so no second copy of the base weights is
  made. It shares the policy's parameters, so it cannot be moved by an update policy.
- ``ReferenceUpdater``: after the optimiser steps, keep the reference fixed, hard-copy the
  policy into it every ``every`` steps (``"sync"``), or mix it in with weight ``alpha``
  (``"ema"``). Only the policy's trainable parameters are moved: frozen ones are equal in
  both models by construction. With a LoRA policy and a ``frozen_copy`` reference, ``"sync"``
  therefore copies the adapter weights, which reproduces the policy exactly. ``"ema"`` is
  refused for LoRA: mixing the two low-rank factors separately does not mix the adapted
  weights (``B A`` is bilinear in the factors), so the result would not be the EMA users ask for.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tether._compat import has_integrated_adapter, has_tuner_layers
from tether.models.weights import load_named
from tether.ops.checks import lookup, real_number, whole_number


def _check_dtype(dtype) -> None:
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be None or a floating torch.dtype, got {dtype!r}; e.g. torch.bfloat16")


def frozen_copy(model: nn.Module, *, device=None, dtype: torch.dtype | None = None) -> nn.Module:
    """A deep copy of ``model`` with gradients off and in eval mode.

    The copy owns its storage: later changes to ``model`` never reach it. ``device`` and
    ``dtype`` place the copy (floating parameters only are cast); ``None`` keeps the
    original's. Tied weights stay tied within the copy.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_dtype(dtype)
    reference = copy.deepcopy(model)
    if device is not None or dtype is not None:
        reference = reference.to(device=device, dtype=dtype)
    reference.requires_grad_(False)
    return reference.eval()


def _is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


@contextmanager
def _adapters_off(policy: nn.Module) -> Iterator[nn.Module]:
    if _is_peft_model(policy):
        with policy.disable_adapter():
            yield policy
        return
    # Adapters attached through transformers' own PEFT integration (model.add_adapter).
    policy.disable_adapters()
    try:
        yield policy
    finally:
        policy.enable_adapters()


class AdapterDisabledReference(nn.Module):
    """The policy with its adapter switched off, used as the frozen reference.

    Calling it runs the policy's forward with the adapter disabled, in eval mode and without
    gradients, and restores the adapter and every submodule's train/eval mode afterwards.
    Its parameters *are* the policy's (no copy): do not call ``requires_grad_(False)`` or
    ``.to(...)`` on it, that would act on the policy. Use ``disabled()`` for anything other
    than a forward pass, e.g. ``generate`` or reading hidden states from the base model.
    """

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    @property
    def config(self):
        return self.policy.config

    def get_output_embeddings(self) -> nn.Module:
        return self.policy.get_output_embeddings()

    def get_input_embeddings(self) -> nn.Module:
        return self.policy.get_input_embeddings()

    @contextmanager
    def disabled(self) -> Iterator[nn.Module]:
        """Context in which the policy behaves as the reference (adapter off, eval mode)."""
        modes = [(module, module.training) for module in self.policy.modules()]
        self.policy.eval()
        try:
            with _adapters_off(self.policy) as base:
                yield base
        finally:
            for module, training in modes:
                module.training = training

    @contextmanager
    def scoring_view(self) -> Iterator[nn.Module]:
        """What ``score_tokens`` scores for this reference: the base model with the adapter
        off, under no-grad, so no gradient reaches the parameters it shares with the policy.
        (Any model may define ``scoring_view``; this is the scorer kind of a shared-weight
        reference.)"""
        with torch.no_grad(), self.disabled() as base:
            yield base

    def forward(self, *args, **kwargs):
        with self.scoring_view() as base:
            return base(*args, **kwargs)


def adapter_disabled(policy: nn.Module) -> AdapterDisabledReference:
    """The reference for a PEFT policy: the same model with its adapter disabled."""
    if not isinstance(policy, nn.Module):
        raise TypeError(f"policy must be a torch.nn.Module, got {type(policy).__name__}")
    if not (_is_peft_model(policy) or has_integrated_adapter(policy)):
        raise TypeError(
            f"policy ({type(policy).__name__}) carries no PEFT adapter; adapter_disabled needs a "
            "peft.PeftModel or a transformers model with an adapter added (model.add_adapter); "
            "for a fully trained policy use frozen_copy(policy) as the reference"
        )
    return AdapterDisabledReference(policy)


# ---------------------------------------------------------------------------------------
# Update policies. Each rule moves one reference tensor towards its policy tensor in place.


def _sync(reference: torch.Tensor, policy: torch.Tensor, alpha: float | None) -> None:
    reference.copy_(policy)


def _ema(reference: torch.Tensor, policy: torch.Tensor, alpha: float | None) -> None:
    # lerp_ computes ref + alpha * (policy - ref) = (1 - alpha) * ref + alpha * policy.
    reference.lerp_(policy.to(device=reference.device, dtype=reference.dtype), alpha)


UpdateRule = Callable[[torch.Tensor, torch.Tensor, "float | None"], None]
REFERENCE_UPDATES: dict[str, UpdateRule | None] = {"fixed": None, "sync": _sync, "ema": _ema}


def _check_mode(mode: str, every: int, alpha: float | None) -> None:
    lookup(REFERENCE_UPDATES, mode, "mode")
    whole_number("every", every, low=1, fix="Pass the number of steps between updates.")
    if mode == "ema":
        real_number("alpha", alpha, low=0, low_open=True, high=1,
                    fix="mode 'ema' needs alpha, the weight of the policy in the mix.")
    elif alpha is not None:
        raise ValueError(f"alpha applies only to mode 'ema', got alpha={alpha!r} with mode {mode!r}; drop it")


def _storage(tensor: torch.Tensor) -> int:
    """Where a tensor's values live; a sharded (DTensor) parameter's local shard."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().data_ptr()


def tracked_pairs(policy: nn.Module, reference: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Trainable policy parameters paired by name with the reference's own tensors."""
    if isinstance(reference, AdapterDisabledReference):
        raise ValueError(
            "reference is adapter_disabled(policy), which shares the policy's weights and has "
            "none of its own to move; use mode='fixed', or frozen_copy(policy) as the reference"
        )
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    pairs = {}
    for name, param in policy.named_parameters():
        if not param.requires_grad:
            continue
        if name not in ref_params:
            raise KeyError(
                f"trainable policy parameter {name!r} has no counterpart in the reference; build "
                "the reference with frozen_copy(policy) so the names match"
            )
        target = ref_params[name]
        if target.shape != param.shape:
            raise ValueError(
                f"parameter {name!r}: policy shape {tuple(param.shape)} != reference shape "
                f"{tuple(target.shape)}; the reference must be a copy of the policy"
            )
        if _storage(target) == _storage(param):
            raise ValueError(
                f"parameter {name!r} shares storage between policy and reference; an update "
                "policy needs an independent reference: use frozen_copy(policy)"
            )
        pairs[name] = (param, target)
    if not pairs:
        raise ValueError(
            "policy has no trainable parameters (all requires_grad=False), so there is nothing "
            "to sync into the reference; unfreeze the policy or use mode='fixed'"
        )
    return pairs


class ReferenceUpdater:
    """Moves a reference model towards the policy on a schedule.

    Args:
        policy: the model being trained.
        reference: its reference, usually ``frozen_copy(policy)``.
        mode: ``"fixed"`` (never move), ``"sync"`` (hard copy) or ``"ema"``
            (``ref <- (1 - alpha) * ref + alpha * policy``).
        every: update after every ``every``-th optimiser step (``step_index % every == 0``).
        alpha: EMA weight of the policy, in ``(0, 1]``; only for ``"ema"``.

    The EMA runs in the reference's dtype; a bfloat16 reference rounds every mix.
    """

    def __init__(
        self,
        policy: nn.Module,
        reference: nn.Module,
        *,
        mode: str = "fixed",
        every: int = 1,
        alpha: float | None = None,
    ) -> None:
        _check_mode(mode, every, alpha)
        self.mode, self.every, self.alpha = mode, every, alpha
        if mode == "ema" and has_tuner_layers(policy):
            raise ValueError(
                "mode 'ema' is refused for a PEFT/LoRA policy: mixing the low-rank factors "
                "separately does not give the EMA of the adapted weights; use mode='sync', or "
                "merge the adapter (merge_and_unload) and train the full model"
            )
        self._rule = REFERENCE_UPDATES[mode]
        self._pairs = {} if self._rule is None else tracked_pairs(policy, reference)
        self.last_step = 0
        self.num_updates = 0

    @property
    def tracked(self) -> list[str]:
        """Names of the parameters this updater moves (empty for ``"fixed"``)."""
        return list(self._pairs)

    def step(self, step_index: int) -> bool:
        """Call after optimiser step ``step_index`` (1, 2, ...); True when the reference moved."""
        whole_number("step_index", step_index, low=1, fix="Pass the number of optimiser steps done.")
        if step_index <= self.last_step:
            raise ValueError(
                f"step_index must increase between calls: got {step_index} after {self.last_step}; "
                "after resuming, load_state_dict restores the last step"
            )
        self.last_step = step_index
        if step_index % self.every != 0:
            return False
        return self.move_now()

    def move_now(self) -> bool:
        """Apply the rule once, off the schedule (a caller's own trigger, e.g. a KL budget that
        keeps binding); True when the reference moved (never for ``"fixed"``)."""
        if self._rule is None:
            return False
        with torch.no_grad():
            for policy_tensor, reference_tensor in self._pairs.values():
                self._rule(reference_tensor, policy_tensor, self.alpha)
        self.num_updates += 1
        return True

    def state_dict(self, *, with_tensors: bool = True) -> dict:
        """Schedule, counters and (for sync/ema) the moved reference tensors, for exact resume.

        ``with_tensors=False`` leaves the tensors out (plain JSON-able values only), for
        callers that save the reference weights themselves, e.g. as safetensors.
        """
        state = {
            "mode": self.mode,
            "every": self.every,
            "alpha": self.alpha,
            "last_step": self.last_step,
            "num_updates": self.num_updates,
        }
        if with_tensors:
            state["reference"] = {name: ref.detach().clone() for name, (_, ref) in self._pairs.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore counters and reference tensors; the schedule must match this updater's.

        A state without ``"reference"`` (``state_dict(with_tensors=False)``) restores the
        counters only and leaves the reference tensors to the caller.
        """
        for key in ("mode", "every", "alpha"):
            if key not in state:
                raise KeyError(f"state lacks {key!r}; pass a dict made by ReferenceUpdater.state_dict()")
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"state[{key!r}] = {state[key]!r} but this updater has {key}={getattr(self, key)!r}; "
                    "build the updater with the same schedule as the one saved"
                )
        if "reference" in state:
            load_named({name: ref for name, (_, ref) in self._pairs.items()}, state["reference"],
                       owner="the reference this updater moves", complete=True,
                       fix="state['reference'] was saved from another model; pass an updater's state of this one.")
        self.last_step = int(state["last_step"])
        self.num_updates = int(state["num_updates"])
