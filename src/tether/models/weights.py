"""Copying named tensors into a model's parameters: the one loader for weights sent or saved.

Rollout workers receive the learner's weights, the reference service receives a moved
reference, checkpoints restore the policy and reference, and ``ReferenceUpdater`` restores the
tensors it moves; all of them copy a ``{name: tensor}`` mapping into named tensors in place, so
they share this function and its errors: a name the model does not have (or, with
``complete``, one it has that was not sent) is a ``KeyError`` and a shape that differs is a
``ValueError``, all raised before anything is copied.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

__all__ = ["load_named"]


def load_named(module: nn.Module | Mapping[str, Tensor], state: Mapping[str, Tensor], *, owner: str, fix: str,
               complete: bool = False) -> int:
    """Copy ``state`` into ``module``'s parameters by name, in place; returns the count copied.

    Args:
        module: the model receiving the tensors (tied parameters are reachable by every name),
            or the named tensors themselves (e.g. the subset of a model that is tracked).
        state: parameter name -> tensor (any device; cast to the parameter's dtype).
        owner: what receives them, for the error (e.g. ``"worker 0's policy"``).
        fix: the sentence telling the user how to send matching tensors.
        complete: also refuse a ``state`` that lacks any of the receiving names.
    """
    params = dict(module.named_parameters(remove_duplicate=False)) if isinstance(module, nn.Module) else dict(module)
    missing = sorted(set(params) - set(state)) if complete else []
    if missing:
        raise KeyError(f"{missing[:5]} of {owner} are missing from the tensors sent. {fix}")
    unknown = sorted(set(state) - set(params))
    if unknown:
        raise KeyError(
            f"{unknown[:5]} are not parameters of {owner} (it has e.g. {sorted(params)[:3]}). {fix}"
        )
    wrong = [f"{n}: {list(state[n].shape)} for {list(params[n].shape)}" for n in sorted(state)
             if state[n].shape != params[n].shape]
    if wrong:
        raise ValueError(f"tensors for {owner} have other shapes than its parameters "
                         f"({'; '.join(wrong[:3])}). {fix}")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
    return len(state)
