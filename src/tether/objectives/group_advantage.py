"""Monte-Carlo group advantages for a whole batch at once, with group labels.

``mc_group_advantages`` is the vectorised core of ``MCAdvantage``: every row is a complete
trajectory, ``group_ids`` says which rows answered the same prompt, and every group is handled
at once by ``tether.ops.group_advantages``. ``reward_to_go=False`` (TorchRL's rule) compares
each reward with its group's; ``reward_to_go=True`` gives token ``t`` its return from ``t`` on
minus the group baseline of total returns (the gradient of a per-token KL penalty in the
reward). A group whose returns are all equal gets 0. Rationale: docs/design.md.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from tether.ops import ADVANTAGE_MODES, STD_MODES, group_advantages, reward_to_go
from tether.ops.checks import lookup


def _unit_scale(totals: Tensor, index: Tensor, counts: Tensor, ddof: int, eps: float) -> Tensor:
    return torch.ones_like(totals)


def _inverse_spread(totals: Tensor, index: Tensor, counts: Tensor, ddof: int, eps: float) -> Tensor:
    groups = counts.numel()
    sums = torch.zeros(groups, dtype=totals.dtype, device=totals.device).index_add(0, index, totals)
    centred = totals - (sums / counts)[index]
    squares = torch.zeros_like(sums).index_add(0, index, centred.square())
    spread = (squares / (counts - ddof).clamp_min(1)).sqrt()
    return 1.0 / (spread[index] + eps)


# How a token's return in excess of its trajectory total is scaled, per advantage mode: the
# derivative of the mode's advantage with respect to a shift of the row's own return that
# leaves the group statistics alone.
_RETURN_SCALES: dict[str, Callable[[Tensor, Tensor, Tensor, int, float], Tensor]] = {
    "grpo": _inverse_spread,
    "dr_grpo": _unit_scale,
    "rloo": _unit_scale,
}


def check_advantage_options(mode: str, std: str) -> None:
    """Raise ``ValueError`` naming the supported values if ``mode`` or ``std`` is unknown."""
    for argument, value, table in (("mode", mode, ADVANTAGE_MODES), ("std", std, STD_MODES)):
        lookup(table, value, argument)


def _as_grid(rewards: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """``rewards [N] | [N, 1] | [N, T] | [N, T, 1]`` -> values ``[N, W]`` and mask ``[N, W]``."""
    if not isinstance(rewards, Tensor):
        raise TypeError(f"rewards must be a torch.Tensor; got {type(rewards).__name__}.")
    if rewards.dim() == 3 and rewards.shape[-1] == 1:
        grid = rewards.squeeze(-1)
    elif rewards.dim() == 1:
        grid = rewards.unsqueeze(-1)
    elif rewards.dim() == 2:
        grid = rewards
    else:
        raise ValueError(
            f"rewards must be [N], [N, 1], [N, T] or [N, T, 1]; got shape {tuple(rewards.shape)}."
        )
    if not grid.is_floating_point():
        grid = grid.to(torch.get_default_dtype())
    if mask is None:
        return grid, torch.ones(grid.shape, dtype=torch.bool, device=grid.device)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError("mask must be None or a bool tensor [N, T]; use mask.bool().")
    if mask.shape != grid.shape:
        raise ValueError(
            f"mask must have the shape {tuple(grid.shape)} of the per-token rewards; got {tuple(mask.shape)}."
        )
    return grid, mask


def mc_group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor | None = None,
    *,
    mode: str = "grpo",
    std: str = "unbiased",
    reward_to_go: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantages of complete trajectories, all groups in one pass.

    Args:
        rewards: ``[N]`` or ``[N, 1]`` one reward per trajectory, or ``[N, T]`` /
            ``[N, T, 1]`` per-token rewards.
        group_ids: ``[N]`` integer labels; rows with the same label answered the same
            prompt. Labels can be any integers in any order; groups can differ in size.
        mask: ``bool [N, T]`` valid reward entries of per-token rewards (None: all).
        mode: ``"grpo"`` (z-score), ``"dr_grpo"`` (centred) or ``"rloo"`` (leave-one-out).
        std: ``"unbiased"`` (Bessel) or ``"population"``, the spread used by ``grpo``.
        reward_to_go: use each token's return (see the module docstring).
        eps: added to the group spread in ``grpo``.

    Returns:
        Advantages with the shape of ``rewards``; 0 at masked entries.

    Worked check: rewards ``[1, 0, 1, 0]`` in one group give ``+-0.866025`` (grpo),
    ``+-0.5`` (dr_grpo), ``+-0.666667`` (rloo).
    """
    check_advantage_options(mode, std)
    grid, valid = _as_grid(rewards, mask)
    if not isinstance(group_ids, Tensor) or group_ids.is_floating_point() or group_ids.is_complex():
        got = group_ids.dtype if isinstance(group_ids, Tensor) else type(group_ids).__name__
        raise TypeError(f"group_ids must be an integer tensor [N]; got {got}. Use group_ids.long().")
    if group_ids.shape != grid.shape[:1]:
        raise ValueError(
            f"group_ids must be [N] = {tuple(grid.shape[:1])}, one label per row of rewards; "
            f"got {tuple(group_ids.shape)}."
        )
    group_ids = group_ids.to(grid.device)
    zero = torch.zeros((), dtype=grid.dtype, device=grid.device)
    if not reward_to_go:
        entry_groups = group_ids[:, None].expand(grid.shape)[valid]
        flat = group_advantages(grid[valid], entry_groups, mode=mode, std=std, eps=eps)
        out = torch.zeros_like(grid).masked_scatter(valid, flat)
    else:
        out = _return_advantages(grid, valid, group_ids, mode, std, eps)
    out = torch.where(valid, out, zero)
    return out.reshape(rewards.shape)


def _return_advantages(grid: Tensor, valid: Tensor, group_ids: Tensor, mode: str, std: str, eps: float) -> Tensor:
    returns = reward_to_go(grid, valid)
    totals = torch.where(valid, grid, torch.zeros_like(grid)).sum(-1)
    per_row = group_advantages(totals, group_ids, mode=mode, std=std, eps=eps)
    _, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    scale = _RETURN_SCALES[mode](totals, index, counts.to(totals.dtype), STD_MODES[std], eps)
    lowest = torch.full((counts.numel(),), float("inf"), dtype=totals.dtype, device=totals.device)
    low = lowest.scatter_reduce(0, index, totals, "amin")
    high = (-lowest).scatter_reduce(0, index, totals, "amax")
    constant = (low == high)[index]
    shifted = per_row[:, None] + (returns - totals[:, None]) * scale[:, None]
    return torch.where(constant[:, None], torch.zeros_like(shifted), shifted)
