"""The step's update and the KL the leash measures it by.

``updates_per_rollout = N`` cuts the step's ``B`` sequences into ``N`` contiguous mini-batches
(sizes differ by at most one; advantages were computed over whole groups before the cut, so the
cut does not change them), each one optimizer step. Mini-batch ``k`` is trained after ``k``
updates, so from the second update on the ratios differ from 1 and the clip, the ESS and the
importance-weighted KL term act; no randomness is drawn for the cut. With ``importance_correction``
(TIS / MIS) ``store_old_log_probs`` scores the trainer's log-probs under the sampling weights once
before the first update. A non-finite loss or gradient norm raises before the weights move.

The leash reads two KLs per answer, summed over its response tokens: sampled, k1 along the
sampled tokens (unbiased but noisy: a batch mean can be negative), and exact, the full-vocabulary
KL at each position of the sampled answers, computed inside the loss pass from the reference's
kept hidden states (two head projections, no extra forward). ``kl_signal=exact`` (default) feeds
``kl_bound`` and the summary; the controller reads the sampled KL of the batch it is about to train
on, known before the update. Without an exact KL (a non-linear head, a Ray ``ReferenceService``)
the sampled one is used and the record says so. ``hold_kl_budget`` measures the updated weights
for ``kl_controller=budget``. Why each signal goes where it does: ``docs/leash.md``. The learning
rate of each step comes from ``make_lr_scheduler`` (warm-up, then ``LR_SCHEDULES``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from tether.control.budget import BudgetMove, pull_under_ceiling
from tether.models.records import StepRecord
from tether.models.score_plan import row_slices
from tether.models.scoring import causal_lm_parts
from tether.objectives import GRPOLossOutput, GRPOTokenTerms
from tether.ops import aggregate, kl_k1, kl_k3
from tether.ops.checks import lookup
from tether.ops.masks import even_slices
from tether.train.run_files import describe_checkpoints
from tether.train.sharded_hold import gathered_line


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
    return even_slices(size, n)


# Without them the loss reads the current policy's log-probs, which is exact for the first update only.
@torch.no_grad()
def store_old_log_probs(actor: Any, record: Any, micro_batch_size: int) -> torch.Tensor:
    """``[B, T]`` the current policy's log-probs of a ``StepRecord``'s answer tokens."""
    parts = [actor.score(part.tokens, part.attention_mask, where=part.assistant_mask).log_probs
             for part in (record.rows(b, e) for b, e in row_slices(len(record), micro_batch_size))]
    return torch.cat(parts).to(record.tokens.device)


# ------------------------------------------------------------------------------ the leash's KL
# The config's kl_signal choices (read by TrainConfig.validate).
KL_SIGNALS: dict[str, str] = {
    "sampled": "k1 summed along the sampled answers",
    "exact": "full-vocabulary KL at every position of the sampled answers",
}


@dataclass(frozen=True)
class KLMeasurement:
    """Per-answer KLs of one batch (``[B]`` each, float64) and its response token count."""

    sampled: Tensor
    exact: Tensor | None
    tokens: int

    @property
    def signal(self) -> Tensor:
        """What the bound and the summary read: the exact KL when there is one."""
        return self.exact if self.exact is not None else self.sampled

    def metrics(self, kl_bound: float, kept: float | None = None) -> dict[str, Any]:
        """Record entries: both KLs per answer (``*_per_seq``) and per token, and the bound check on
        the weights kept (``kept``, their KL per answer) or, unread, the weights that sampled."""
        per_token = max(self.tokens, 1)
        out: dict[str, Any] = {
            "kl_per_seq": float(self.sampled.mean()),
            "kl_per_token": float(self.sampled.sum()) / per_token,
        }
        if self.exact is not None:
            out["kl_exact_per_seq"] = float(self.exact.mean())
            out["kl_exact_per_token"] = float(self.exact.sum()) / per_token
        measured = float(self.signal.mean())
        out["kl_signal"] = "exact" if self.exact is not None else "sampled"
        out["kl_over_bound"] = bool(kl_bound) and (measured if kept is None else kept) > kl_bound
        return out


def behaviour_kl(terms: GRPOTokenTerms) -> float:
    """KL(sampler || learner) per answer token: k3 of the learner's log-probs against the sampler's
    on the sampled tokens, the sampler-trainer mismatch (NeMo-RL logs it as token_mult_prob_error).
    Over every update's mini-batch: with one update a rollout, the learner is the sampling weights."""
    log_weights = terms.log_weights  # learner minus sampler, 0 off the answers (k3 of 0 is 0)
    return float(aggregate(kl_k3(torch.zeros_like(log_weights), log_weights), terms.mask, "token-mean"))


def has_exact_kl(policy: torch.nn.Module) -> bool:
    """Whether the policy's logits are a linear head of its hidden states (exact KL possible)."""
    return causal_lm_parts(policy).decoder is not None


def measure_kl(sampled: Tensor, exact_tokens: Tensor | None, mask: Tensor) -> KLMeasurement:
    """Both KLs of a batch.

    Args:
        sampled: ``[B]`` summed ``log pi - log pi_ref`` of each answer's sampled tokens.
        exact_tokens: ``[B, T]`` exact KL per token (``GRPOTokenTerms.kl_to_ref_exact``), or None.
        mask: ``bool [B, T]`` the answer tokens.
    """
    exact = None if exact_tokens is None else (exact_tokens * mask.to(exact_tokens.device)).sum(-1).double().cpu()
    return KLMeasurement(sampled=sampled.detach().double().cpu(), exact=exact, tokens=int(mask.sum()))


def answer_kl(actor: Any, record: StepRecord) -> Tensor:
    """``[B]`` the KL of ``actor``'s model to the reference along each of ``record``'s answers:
    exact over the vocabulary from ``record.ref_hidden``, else k1 of the sampled tokens against
    ``record.ref_log_probs`` (a reference that returned log-probs only)."""
    mask, exact = record.assistant_mask, record.ref_hidden is not None
    scored = actor.score(record.tokens, record.attention_mask, where=mask, kl_to=record.ref_hidden, log_probs=not exact)
    per_token = scored.exact_kl if exact else kl_k1(scored.log_probs, record.ref_log_probs)
    return (per_token.double() * mask.to(per_token.device)).sum(-1).cpu()


# A move scales the whole update, so every answer's exact KL moves by nearly the same factor: a
# reading after a move reads every third answer of each group and scales the first reading's level
# by their paired ratio. Whole groups would read fewer prompts, but answers to one prompt move
# alike: at 3 nats a third of the groups missed the full reading by 7-10 % on average, a third of
# each group's answers by 2 % (benchmarks/confirm_ratio.py, docs/leash.md). The k1 of a
# log-probs-only reference can be negative per answer: no ratio there.
CONFIRM_EVERY = 3


def confirm_rows(record: StepRecord, every: int) -> Tensor:
    """``long [n]``: the rows of ``record`` whose place among their group's answers (0, 1, ...)
    is a multiple of ``every``, in row order; a group is whole on one rank, so the rows do not
    depend on how ``--nproc`` splits the step."""
    ids = record.group_ids
    place = torch.tril(ids[:, None] == ids[None, :], diagonal=-1).sum(1)  # earlier answers of its group
    return torch.nonzero(place % every == 0).squeeze(-1)


class KLReadings:
    """``measure`` for the leash: the mean KL per answer of the current weights over every rank's
    rows. The first reading reads every row; later estimates read ``confirm_rows`` and scale the
    first level by their paired ratio; ``full=True`` reads every row, only the rows the last
    estimate left out when it was taken at the current weights (``moved`` forgets it)."""

    def __init__(self, run: Any, record: StepRecord, confirm_every: int) -> None:
        self.run, self.record = run, record
        self.part = None if confirm_every == 1 or record.ref_hidden is None else confirm_rows(record, confirm_every)
        self.first: Tensor | None = None  # totals over ranks: KL sum, answers, KL sum of `part`
        self.last_part: Tensor | None = None  # the KL sum of `part` at the current weights

    def _read(self, rows: Tensor | None = None) -> Tensor:
        with self.run.ranks.unsharded():
            return answer_kl(self.run.actor, self.record if rows is None else self.record.take(rows))

    def moved(self) -> None:
        self.last_part = None

    def __call__(self, full: bool = False) -> float:
        ranks = self.run.ranks
        if self.first is None:
            kl = self._read()
            parts = [kl.sum(), torch.tensor(float(len(kl)), dtype=torch.float64)]
            self.first = ranks.total(torch.stack(parts + ([kl[self.part].sum()] if self.part is not None else [])))
            self.last_part = self.first[2] if self.part is not None else None
            return float(self.first[0] / self.first[1])
        total = self.first
        if self.part is None or not total[2] > 0:
            return float(ranks.total(self._read().sum()) / total[1])
        if full:
            if self.last_part is None:
                return float(ranks.total(self._read().sum()) / total[1])
            rest = torch.ones(len(self.record), dtype=torch.bool)
            rest[self.part] = False
            rest_sum = ranks.total(self._read(torch.nonzero(rest).squeeze(-1)).sum())
            return float((self.last_part + rest_sum) / total[1])
        self.last_part = ranks.total(self._read(self.part).sum())
        return float(total[0] / total[1] * self.last_part / total[2])


@dataclass
class TrackedLine:
    """The run's line, telling the readings whenever the weights move."""

    line: Any
    readings: KLReadings

    def capture(self) -> None:
        self.line.capture()

    def place(self, scale: float) -> None:
        self.readings.moved()
        self.line.place(scale)

    def reject(self) -> None:
        self.readings.moved()
        self.line.reject()


def mark_step_start(run: Any) -> None:
    """``kl_controller=budget``, before the update: the weights and optimizer state a rejected
    update returns to (one copy of what the optimizer trains)."""
    if run.line is not None and run.cfg.kl_controller == "budget":
        run.line.start(run.optimizer)


@torch.no_grad()
def hold_kl_budget(run: Any, record: StepRecord, *, confirm_every: int = CONFIRM_EVERY) -> BudgetMove | None:
    """After the optimizer step: the leash on the weights kept. ``kl_controller=budget`` moves the
    update into the band or rejects it (the controller's ``hold``); every controller then keeps the
    weights under ``kl_bound`` (``pull_under_ceiling``). Returns the move, timed; None with neither
    (``kl_bound=0`` and another controller)."""
    if run.line is None:  # built by build_run for the budget or a ceiling
        return None
    start, ceiling = time.perf_counter(), run.cfg.kl_bound or math.inf
    held = gathered_line(run)  # on several ranks the weights are gathered once for every reading
    readings = KLReadings(run, record, confirm_every)
    line = TrackedLine(held, readings)
    try:
        if run.cfg.kl_controller == "budget":
            move = run.controller.hold(line, readings, ceiling=ceiling)
        else:
            kl = readings(full=True)
            scale, kept, spent = 1.0, kl, 0
            if kl > ceiling:
                scale, kept, spent = pull_under_ceiling(line, readings, kl, ceiling=ceiling, aim=run.cfg.kl_target)
            move = BudgetMove(kl, kept, scale, 1 + spent)
    finally:
        held.release()
    return dataclasses.replace(move, seconds=time.perf_counter() - start)


# ------------------------------------------------------------------------------ learning-rate schedule
# The unit is the training step (one rollout), the unit of ``steps`` and ``checkpoint_every``: with
# ``updates_per_rollout > 1`` every update of a step uses that step's learning rate. The multiplier of
# step ``s`` (0-based, the step being taken) is ``(s + 1) / (warmup + 1)`` during warm-up, so the first
# step already moves the weights, and afterwards ``f(p)`` with ``p = (s - warmup) / (steps - warmup)``
# the fraction of the decay done: ``1`` (constant), ``1 - p`` (linear) or ``(1 + cos(pi p)) / 2``
# (cosine). The scheduler's state is saved in the checkpoint. The horizon is the run's ``steps``:
# extending a run with ``--resume --steps N`` stretches the rest of the decay over the new horizon.
LR_SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda done: 1.0,
    "linear": lambda done: 1.0 - done,
    "cosine": lambda done: 0.5 * (1.0 + math.cos(math.pi * done)),
}


def lr_multiplier(step: int, *, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Factor on the base learning rate for the 0-based ``step`` of a run of ``total_steps``."""
    decay = lookup(LR_SCHEDULES, schedule, "lr_schedule")
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    span = max(total_steps - warmup_steps, 1)
    return decay(min((step - warmup_steps) / span, 1.0))


def make_lr_scheduler(optimizer: torch.optim.Optimizer, *, schedule: str, warmup_steps: int,
                      total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` stepped once per training step; its ``last_epoch`` is the next step's index."""
    lookup(LR_SCHEDULES, schedule, "lr_schedule")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(step, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps),
    )
