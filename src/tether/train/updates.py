"""Several updates per rollout: the step's batch cut into mini-batches, each one optimizer step.

``updates_per_rollout = N`` cuts the step's ``B`` sequences into ``N`` contiguous mini-batches
(sizes differ by at most one; advantages were computed over whole groups before the cut, so
the cut does not change them). Mini-batch ``k`` is trained after ``k`` updates, so its
sampling log-probs are the old log-probs of the ratio: from the second update on the ratios
differ from 1 and the clip, the ESS and the importance-weighted KL term act. ``N = 1`` is the
one on-policy update of the plain recipe. No randomness is drawn for the cut.

With ``importance_correction`` (TIS / MIS) ``GRPOLoss`` reads the trainer's log-probs under
the sampling weights from ``old_log_probs``; if absent it takes the current policy, which is
exact only for the first update. ``store_old_log_probs`` scores them once before the first
update, micro-batch by micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch


def minibatch_bounds(size: int, n: int) -> list[tuple[int, int]]:
    """``(begin, end)`` of ``n`` contiguous slices of ``range(size)``, the first ``size % n`` one longer."""
    if not 1 <= n <= size:
        raise ValueError(f"updates_per_rollout: expected 1..{size} (the batch's sequences), got {n}; "
                         "lower updates_per_rollout or raise prompts_per_step * group_size.")
    base, extra = divmod(size, n)
    bounds, begin = [], 0
    for k in range(n):
        end = begin + base + (1 if k < extra else 0)
        bounds.append((begin, end))
        begin = end
    return bounds


@torch.no_grad()
def row_slices(size: int, micro_batch_size: int) -> list[tuple[int, int]]:
    """``(begin, end)`` of consecutive micro-batches of ``micro_batch_size`` rows (the last may be shorter)."""
    return [(begin, min(begin + micro_batch_size, size)) for begin in range(0, size, micro_batch_size)]


@torch.no_grad()
def store_old_log_probs(actor: Any, record: Any, micro_batch_size: int) -> torch.Tensor:
    """``[B, T]`` the current policy's log-probs of a ``StepRecord``'s answer tokens."""
    parts = [actor.score(part.tokens, part.attention_mask, where=part.assistant_mask).log_probs
             for part in (record.rows(b, e) for b, e in row_slices(len(record), micro_batch_size))]
    return torch.cat(parts).to(record.tokens.device)
