"""Several updates per rollout: the step's batch cut into mini-batches, each one optimizer step.

``updates_per_rollout = N`` cuts the step's ``B`` sequences into ``N`` contiguous mini-batches
(sizes differ by at most one; advantages were computed over whole groups before the cut, so
the cut does not change them). Mini-batch ``k`` is trained after ``k`` updates, so its
sampling log-probs are the old log-probs of the ratio: from the second update on the ratios
differ from 1 and the clip, the ESS and the importance-weighted KL term act. ``N = 1`` is the
one on-policy update of the plain recipe. No randomness is drawn for the cut.

With ``importance_correction`` (TIS / MIS) the loss reads the trainer's log-probs under
the sampling weights from ``old_log_probs``; if absent it takes the current policy, which is
exact only for the first update. ``store_old_log_probs`` scores them once before the first
update, micro-batch by micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tether.models.score_plan import row_slices
from tether.objectives import GRPOLossOutput, GRPOTokenTerms
from tether.train.checkpoint import describe_checkpoints


@dataclass
class Update:
    """What the step's updates report: the loss's output over the whole batch (every update's
    per-token terms reduced together), the mean gradient norm, and the per-token terms."""

    output: GRPOLossOutput
    grad_norm: float
    terms: GRPOTokenTerms


class NonFiniteUpdateError(ValueError):
    """A step's loss or gradient norm is NaN or infinite; the optimizer step was not taken."""


def check_finite_update(loss: float, grad_norm: float, step: int, run_dir: Path) -> None:
    """Raise ``NonFiniteUpdateError`` (naming step ``step + 1`` and the run's checkpoints) unless both are finite."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteUpdateError(
            f"step {step + 1}: loss {loss}, gradient norm {grad_norm}; the update was not applied, logged or "
            f"checkpointed. Lower learning_rate, set grad_clip, or check the rewards' scale. {describe_checkpoints(run_dir)}"
        )


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
def store_old_log_probs(actor: Any, record: Any, micro_batch_size: int) -> torch.Tensor:
    """``[B, T]`` the current policy's log-probs of a ``StepRecord``'s answer tokens."""
    parts = [actor.score(part.tokens, part.attention_mask, where=part.assistant_mask).log_probs
             for part in (record.rows(b, e) for b, e in row_slices(len(record), micro_batch_size))]
    return torch.cat(parts).to(record.tokens.device)
