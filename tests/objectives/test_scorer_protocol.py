"""``GRPOLoss`` reads what its policy can do from the ``Scorer`` protocol's flag, not its type."""

from __future__ import annotations

import torch

from tether.objectives import GRPOLoss
from tests.objectives.helpers import make_batch, tiny_wrapper, two_row_grid


class Delegate:
    """Any object (not a TransformersWrapper) scoring through one, recording the keywords it got."""

    def __init__(self, wrapper, scores_positions: bool) -> None:
        self.wrapper, self.scores_positions, self.calls = wrapper, scores_positions, []

    def score(self, tokens, attention_mask, **kwargs):
        self.calls.append(sorted(kwargs))
        return self.wrapper.score(tokens, attention_mask, **kwargs)


def test_a_scorer_that_declares_positions_gets_them_and_one_that_does_not_gets_the_short_form():
    """The flag decides the call: ``where``/``kl_to`` go to a declaring scorer only. Both give the
    wrapper's own loss (scoring only the trained positions changes no value there)."""
    wrapper = tiny_wrapper()
    tokens, attention, loss_mask = two_row_grid()
    batch = make_batch(wrapper, tokens, attention, loss_mask, torch.tensor([1.0, -2.0]))
    expected = GRPOLoss(wrapper)(batch).loss_objective
    full, short = Delegate(wrapper, True), Delegate(wrapper, False)
    torch.testing.assert_close(GRPOLoss(full)(batch).loss_objective, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(GRPOLoss(short)(batch).loss_objective, expected, rtol=0, atol=1e-12)
    assert full.calls == [["kl_to", "where", "with_entropy"]]
    assert short.calls == [["with_entropy"]]
