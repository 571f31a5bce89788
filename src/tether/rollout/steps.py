"""Episode bookkeeping of a token rollout: where it ends, and its per-step token views.

Step ``i`` of a response observes the prompt plus the first ``i`` response tokens. The seed
materialised that as ``[B, N, L + N]`` tensors (quadratic); tether stores the final sequence
once (a stride-0 view over the steps) and builds TorchRL's tensors on request with
``stepwise_views`` (``clone()`` of such a TensorDict copies the expanded view).

Fixed where TorchRL was off: ``done`` is True exactly once per row (first eos of the
response, or the last step); ``truncated`` is ``done`` without an eos and an eos at the last
step terminates; the end is searched for among the response tokens only.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from torch import Tensor

from tether.models.batch_io import has_key, missing_key

__all__ = ["EpisodeEnds", "StepViews", "episode_ends", "stepwise_views"]


@dataclass(frozen=True)
class EpisodeEnds:
    """Where each response ends.

    Attributes:
        done_index: ``long [B]``, step of the first eos, or ``N - 1`` without one.
        has_eos: ``bool [B]``, the response contains an eos (terminated, not truncated).
        step_mask: ``bool [B, N]``, True on the steps up to and including ``done_index``.
    """

    done_index: Tensor
    has_eos: Tensor
    step_mask: Tensor

    @property
    def num_tokens(self) -> Tensor:
        """``long [B]``: response tokens kept, the eos included."""
        return self.done_index + 1

    def done_flags(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(done, terminated, truncated)``, each ``bool [B, N, 1]``."""
        steps = self.step_mask.shape[-1]
        positions = torch.arange(steps, device=self.done_index.device)
        done = positions == self.done_index[:, None]
        terminated = done & self.has_eos[:, None]
        truncated = done & ~self.has_eos[:, None]
        return done[..., None], terminated[..., None], truncated[..., None]


def episode_ends(action: Tensor, eos_ids: Collection[int]) -> EpisodeEnds:
    """Locate the end of each response.

    Args:
        action: ``long [B, N]``, the response tokens (one per step).
        eos_ids: ids that end a response.

    Returns:
        ``EpisodeEnds`` with the first eos of each row, or the last step if none.
    """
    steps = action.shape[-1]
    eos = torch.tensor(sorted(eos_ids), dtype=action.dtype, device=action.device)
    is_eos = torch.isin(action, eos)
    has_eos = is_eos.any(-1)
    # argmax over a 0/1 tensor returns the first maximum, i.e. the first eos.
    first = is_eos.to(torch.uint8).argmax(-1)
    done_index = torch.where(has_eos, first, steps - 1)
    positions = torch.arange(steps, device=action.device)
    return EpisodeEnds(done_index=done_index, has_eos=has_eos, step_mask=positions <= done_index[:, None])


@dataclass(frozen=True)
class StepViews:
    """The seed's step-wise token tensors, each ``[..., W]`` with ``W = L + N``.

    Attributes:
        input_ids: ids visible before the step's action (padding after them).
        attention_mask: ``bool``, True on those ids.
        next_input_ids: ids visible after the action.
        next_attention_mask: ``bool``, True on those ids.
    """

    input_ids: Tensor
    attention_mask: Tensor
    next_input_ids: Tensor
    next_attention_mask: Tensor


def stepwise_views(td: TensorDictBase, pad_token_id: int) -> StepViews:
    """Materialise the per-step token views of a rollout (costs ``O(B * N * (L + N))``).

    Args:
        td: a rollout from ``RolloutFromModel`` (or any slice of one along batch or time)
            holding ``"sequence"`` ``[..., W]``, ``"length"`` and ``("next", "length")``.
        pad_token_id: id written after the visible tokens.

    Returns:
        ``StepViews``; position ``t`` of step ``i`` is visible when ``t < length[i]``.
    """
    missing = [key for key in ("sequence", "length", ("next", "length")) if not has_key(td, key)]
    if missing:
        raise missing_key(td, missing, "Pass the TensorDict returned by create_rollout_td / rollout_from_data.",
                          what="the entries of a RolloutFromModel output")
    sequence = td.get("sequence")
    positions = torch.arange(sequence.shape[-1], device=sequence.device)
    mask = positions < td.get("length")[..., None]
    next_mask = positions < td.get(("next", "length"))[..., None]
    return StepViews(
        input_ids=sequence.masked_fill(~mask, pad_token_id),
        attention_mask=mask,
        next_input_ids=sequence.masked_fill(~next_mask, pad_token_id),
        next_attention_mask=next_mask,
    )
