"""Group-relative advantages (GRPO, Dr. GRPO, RLOO) and per-token reward-to-go.

Groups are given either as rows of a ``[num_groups, G]`` tensor or as integer labels
beside flat ``[N]`` rewards; labels can be any integers, in any order, and groups can have
different sizes. Statistics are gathered with ``index_add``/``scatter_reduce`` over the
labels, never with a Python loop over groups.

Departures from the papers, on purpose:

* a group whose rewards are all equal gets exactly 0 (detected as ``min == max``, so no
  rounding residue of the mean and no 0/0);
* ``grpo`` on a group of one sample gives 0: its centred reward is 0 and its spread is
  taken as 0 (Bessel's correction has nothing to correct with one sample);
* ``rloo`` on a group of one sample is an error, since there is no other sample to form
  the baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from tether.ops.checks import lookup, real_number


@dataclass(frozen=True)
class _GroupStats:
    """Per-sample views of its group's statistics, all ``[N]`` float64."""

    centred: Tensor  # reward minus the group mean
    count: Tensor  # group size
    spread: Tensor  # group standard deviation (ddof from ``std``)


def _grpo(stats: _GroupStats, eps: float) -> Tensor:
    return stats.centred / (stats.spread + eps)


def _dr_grpo(stats: _GroupStats, eps: float) -> Tensor:
    return stats.centred


def _rloo(stats: _GroupStats, eps: float) -> Tensor:
    # r_i - mean of the others = n / (n - 1) * (r_i - group mean).
    n = stats.count.to(stats.centred.dtype)
    return stats.centred * n / (n - 1)


ADVANTAGE_MODES: dict[str, Callable[[_GroupStats, float], Tensor]] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
}

# Delta degrees of freedom of the group standard deviation.
STD_MODES: dict[str, int] = {
    "unbiased": 1,
    "population": 0,
}


def _flat_groups(rewards: Tensor, group_ids: Tensor | None) -> tuple[Tensor, Tensor, int, Tensor | None]:
    """Flat rewards ``[N]``, dense group index ``[N]``, group count, original labels (None for rows)."""
    if rewards.dim() == 2:
        if group_ids is not None:
            raise ValueError(
                f"group_ids must be None when rewards is 2-D [num_groups, G] (each row is a group); "
                f"got rewards {tuple(rewards.shape)} with group_ids. Flatten rewards to [N] to use labels."
            )
        rows, size = rewards.shape
        index = torch.arange(rows, device=rewards.device).repeat_interleave(size)
        return rewards.reshape(-1), index, rows, None
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be [N] (with group_ids) or [num_groups, G]; got shape {tuple(rewards.shape)}. "
            "Squeeze a trailing reward dimension first."
        )
    if group_ids is None:
        return rewards, torch.zeros_like(rewards, dtype=torch.long), 1, None
    if not isinstance(group_ids, Tensor) or group_ids.is_floating_point() or group_ids.is_complex():
        got = group_ids.dtype if isinstance(group_ids, Tensor) else type(group_ids).__name__
        raise TypeError(f"group_ids must be an integer tensor [N]; got {got}. Use group_ids.long().")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids must have the shape of rewards {tuple(rewards.shape)}; got {tuple(group_ids.shape)}."
        )
    labels, index = torch.unique(group_ids, sorted=True, return_inverse=True)
    return rewards, index, labels.numel(), labels


def _check_rloo_sizes(counts: Tensor, labels: Tensor | None) -> None:
    small = counts < 2
    if not bool(small.any()):
        return
    which = torch.nonzero(small).flatten()
    named = which if labels is None else labels[which]
    kind = "row" if labels is None else "group id"
    raise ValueError(
        f"mode='rloo' needs at least 2 samples per group for the leave-one-out baseline; "
        f"{kind}(s) {named.tolist()} have 1. Sample more per prompt or use mode='grpo'/'dr_grpo'."
    )


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor | None = None,
    *,
    mode: str = "grpo",
    std: str = "unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """Advantages of each sample relative to the other samples of its group.

    Args:
        rewards: ``[N]`` scalar rewards with ``group_ids``, or ``[num_groups, G]`` with each
            row a group (``group_ids=None``). ``[N]`` without labels is one group.
        group_ids: ``[N]`` integer group labels (any values, any order) or ``None``.
        mode: a key of ``ADVANTAGE_MODES``:

            * ``grpo``: ``(r - mean) / (std + eps)``;
            * ``dr_grpo``: ``r - mean`` (no division by the spread);
            * ``rloo``: ``r - mean of the other G - 1 rewards``.
        std: a key of ``STD_MODES``, the spread used by ``grpo``: ``"unbiased"`` (Bessel,
            divide by ``G - 1``) or ``"population"`` (divide by ``G``).
        eps: added to the spread in ``grpo``.

    Returns:
        Advantages with the shape of ``rewards`` (float; integer rewards are promoted to
        the default float dtype). All-equal groups give exactly 0.

    Worked check: ``[1, 0, 1, 0]`` gives ``+-sqrt(3)/2`` (grpo, Bessel), ``+-1`` (population),
    ``+-0.5`` (dr_grpo), ``+-2/3`` (rloo).
    """
    advantage = lookup(ADVANTAGE_MODES, mode, "mode")
    ddof = lookup(STD_MODES, std, "std")
    if not isinstance(rewards, Tensor):
        raise TypeError(f"rewards must be a torch.Tensor; got {type(rewards).__name__}.")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    flat, index, groups, labels = _flat_groups(rewards, group_ids)

    counts = torch.zeros(groups, dtype=torch.long, device=flat.device).index_add_(0, index, torch.ones_like(index))
    if mode == "rloo":
        _check_rloo_sizes(counts, labels)
    # In float64 a group's sum and squares of any float32 / bf16 rewards fit (|r| <= 3.4e38, so
    # r**2 <= 1.2e77), so nothing is rescaled; the advantages go back to the rewards' dtype.
    wide = flat.to(torch.float64)
    low = wide.new_zeros(groups).scatter_reduce(0, index, wide, "amin", include_self=False)
    high = torch.zeros_like(low).scatter_reduce(0, index, wide, "amax", include_self=False)
    sums = torch.zeros_like(low).index_add(0, index, wide)
    centred = wide - (sums / counts.clamp_min(1))[index]
    squares = torch.zeros_like(sums).index_add(0, index, centred.square())
    spread = (squares / (counts - ddof).clamp_min(1)).sqrt()

    result = advantage(_GroupStats(centred=centred, count=counts[index], spread=spread[index]), eps)
    constant = (low == high)[index]
    result = torch.where(constant, torch.zeros_like(result), result).to(flat.dtype)
    _check_representable(result, spread, flat, mode)
    return result.reshape(rewards.shape)


def _check_representable(result: Tensor, spread: Tensor, rewards: Tensor, mode: str) -> None:
    # One host read per batch of rewards: an advantage that does not fit the dtype (dr_grpo / rloo on
    # float32 rewards near its limit) must not reach the loss as inf, nor a spread that overflowed
    # float64 (rewards past ~1e154) turn grpo's advantages into zeros.
    if bool((torch.isfinite(result).all() & torch.isfinite(spread).all())):
        return
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(
            "rewards must be finite; got NaN or inf. Fix the reward function, or replace "
            "failed rewards by a number before computing advantages."
        )
    fix = "rescale the rewards" + (" or pass them as float64" if rewards.dtype != torch.float64 else "")
    raise ValueError(
        f"mode={mode!r}: an advantage does not fit in {rewards.dtype} (rewards up to "
        f"{float(rewards.abs().max()):.3g}); {fix}."
    )


def reward_to_go(rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Discounted sum of the rewards from each valid token to the end of its row.

    ``G_t = r_t + gamma * G_next`` where ``next`` is the next *valid* token: masked
    positions (padding, tool output) contribute nothing, are not counted as steps for the
    discount, and get 0.

    Args:
        rewards: ``[B, T]`` per-token rewards.
        mask: ``bool [B, T]`` valid tokens.
        gamma: discount in ``[0, 1]``.

    Returns:
        ``[B, T]`` returns, 0 at masked positions; differentiable w.r.t. ``rewards``.
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError("mask must be a bool tensor [B, T]; use mask.bool().")
    if not isinstance(rewards, Tensor) or rewards.dim() != 2 or rewards.shape != mask.shape:
        got = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(
            f"rewards must be [B, T] with the mask's shape {tuple(mask.shape)}; got {got}. "
            "Squeeze a trailing reward dimension of [B, T, 1] first."
        )
    real_number("gamma", gamma, low=0, high=1)
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    kept = torch.where(mask, rewards, zero)
    if gamma == 1.0:
        return torch.where(mask, kept.flip(-1).cumsum(-1).flip(-1), zero)
    # Discounting by valid steps cannot be written as one cumsum without dividing by
    # gamma ** t, which underflows for long rows; a reverse scan over T stays exact.
    running = torch.zeros_like(kept[:, 0])
    columns = []
    for t in range(kept.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], kept[:, t] + gamma * running, running)
        columns.append(torch.where(mask[:, t], running, zero))
    if not columns:
        return kept
    return torch.stack(columns[::-1], dim=1)
