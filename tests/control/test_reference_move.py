"""``ReferenceMover``: the reference advances exactly after ``after`` pulled-back steps in a row.

A 2-parameter float64 model (``nn.Linear(1, 1)``) stands for the policy: the plant is a
sequence of ``BudgetMove`` records (scale < 1 or rejected: pulled back; scale 1: not), so the
trigger is tested without a model's KL; the moves' values are derived by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tether.control import BudgetMove, ReferenceMover
from tether.models import frozen_copy

KEPT, PULLED, REJECTED = BudgetMove(1.0, 1.0, 1.0, 1), BudgetMove(4.0, 1.0, 0.5, 2), BudgetMove(9.0, 0.0, 1.0, 5, True)


def _pair(w: float = 0.0, b: float = 0.0) -> tuple[nn.Linear, nn.Linear]:
    policy = nn.Linear(1, 1).double()
    with torch.no_grad():
        policy.weight.fill_(w)
        policy.bias.fill_(b)
    return policy, frozen_copy(policy)


def _set(policy: nn.Linear, w: float, b: float) -> None:
    with torch.no_grad():
        policy.weight.fill_(w)
        policy.bias.fill_(b)


def _ref(reference: nn.Linear) -> tuple[float, float]:
    return float(reference.weight), float(reference.bias)


@pytest.mark.parametrize("after", [1, 2, 3])
def test_moves_exactly_after_m_pulled_back_steps_in_a_row(after):
    """Plant: K P P K P R P P P (K kept, P pulled back, R rejected). A streak counts P and R and
    a K clears it; a move clears it too. With after=2 the streaks reach 2 at steps 3, 6 and 8;
    with 3 at steps 7 only (P R P, then P P after it is 2 short); with 1 at every P or R."""
    plant = [KEPT, PULLED, PULLED, KEPT, PULLED, REJECTED, PULLED, PULLED, PULLED]
    expected = {1: [2, 3, 5, 6, 7, 8, 9], 2: [3, 6, 8], 3: [7]}[after]
    policy, reference = _pair()
    mover = ReferenceMover(policy, reference, mode="reset", after=after)
    moved = [i + 1 for i, move in enumerate(plant) if mover.observe(move)]
    assert moved == expected
    assert mover.moves == len(expected)


def test_reset_copies_the_kept_weights_and_ema_takes_alpha_of_the_way():
    """reset: ref = policy. ema with alpha 0.25 from ref (0, 0) to policy (2, -4): (0.5, -1);
    after the policy moves to (4, 4), a second move: (0.5 + 0.25 * 3.5, -1 + 0.25 * 5) = (1.375, 0.25)."""
    policy, reference = _pair()
    mover = ReferenceMover(policy, reference, mode="reset", after=1)
    _set(policy, 2.0, -4.0)
    assert mover.observe(PULLED) and _ref(reference) == (2.0, -4.0)
    policy, reference = _pair()
    mover = ReferenceMover(policy, reference, mode="ema", after=1, alpha=0.25)
    _set(policy, 2.0, -4.0)
    mover.observe(PULLED)
    assert _ref(reference) == (0.5, -1.0)
    _set(policy, 4.0, 4.0)
    assert not mover.observe(KEPT) and _ref(reference) == (0.5, -1.0)
    mover.observe(REJECTED)
    assert _ref(reference) == pytest.approx((1.375, 0.25), abs=1e-15)


def test_state_round_trip_resumes_the_streak():
    """A mover restored after P P (after=3) moves at the next P, as the uninterrupted one does."""
    policy, reference = _pair(1.0, 1.0)
    first = ReferenceMover(policy, reference, mode="reset", after=3)
    first.observe(PULLED), first.observe(PULLED)
    second = ReferenceMover(policy, reference, mode="reset", after=3)
    second.load_state_dict(first.state_dict())
    assert second.state_dict() == {"mode": "reset", "after": 3, "alpha": None, "streak": 2, "moves": 0}
    assert second.observe(PULLED) and second.moves == 1 and second.streak == 0


def test_bad_arguments_and_states_are_named():
    policy, reference = _pair()
    with pytest.raises(ValueError, match="reference_move: 'off' builds no mover"):
        ReferenceMover(policy, reference, mode="off", after=1)
    with pytest.raises(ValueError, match="reference_move"):
        ReferenceMover(policy, reference, mode="sometimes", after=1)
    with pytest.raises(ValueError, match="reference_move_after"):
        ReferenceMover(policy, reference, mode="reset", after=0)
    with pytest.raises(ValueError, match="reference_move_alpha"):
        ReferenceMover(policy, reference, mode="ema", after=1, alpha=1.5)
    mover = ReferenceMover(policy, reference, mode="reset", after=2)
    with pytest.raises(ValueError, match="after=2 .*|checkpoint's after=3"):
        mover.load_state_dict({**mover.state_dict(), "after": 3})
    with pytest.raises(KeyError, match="missing \\['moves'\\]"):
        mover.load_state_dict({k: v for k, v in mover.state_dict().items() if k != "moves"})


def test_budget_lr_follows_the_kept_scale_by_hand():
    """gain 1: pulled to 0.5 -> 0.5; to 0.8 -> 0.4; kept -> 0.6, 0.9, then 1 (capped at the
    schedule's rate); rejected -> 0.5. gain 0.5: pulled to 0.25 -> 0.25 ** 0.5 = 0.5; kept ->
    0.5 * 1.5 ** 0.5."""
    from tether.train.variants import BudgetLR

    lr = BudgetLR(gain=1.0)
    got = [lr.observe(m) for m in (PULLED, BudgetMove(2.0, 1.0, 0.8, 2), KEPT, KEPT, KEPT, REJECTED)]
    assert got == pytest.approx([0.5, 0.4, 0.6, 0.9, 1.0, 0.5], rel=1e-15)
    lr = BudgetLR(gain=0.5)
    assert lr.observe(BudgetMove(16.0, 1.0, 0.25, 2)) == pytest.approx(0.5, rel=1e-15)
    assert lr.observe(KEPT) == pytest.approx(0.5 * 1.5 ** 0.5, rel=1e-15)
