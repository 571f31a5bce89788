"""Copying named tensors into a model's parameters: the one loader for weights sent or saved.

Rollout workers receive the learner's weights, the reference service receives a moved
reference, and checkpoints restore the policy and reference; all of them copy a
``{name: tensor}`` mapping into ``named_parameters()`` in place, so they share this
function and its errors: a name the model does not have is a ``KeyError`` and a shape
that differs is a ``ValueError``, both raised before anything is copied.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

__all__ = ["load_named"]


def load_named(module: nn.Module, state: Mapping[str, Tensor], *, owner: str, fix: str) -> int:
    """Copy ``state`` into ``module``'s parameters by name, in place; returns the count copied.

    Args:
        module: the model receiving the tensors (tied parameters are reachable by every name).
        state: parameter name -> tensor (any device; cast to the parameter's dtype).
        owner: what receives them, for the error (e.g. ``"worker 0's policy"``).
        fix: the sentence telling the user how to send matching tensors.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
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
