"""Each public piece's docstring carries an ``Examples`` section, and its examples run and print
what they say (values derived in the examples' comments). The Ray pieces' examples run in
``tests/ray/test_docstring_examples.py`` on the session's local cluster."""

from __future__ import annotations

import pytest

from tests.docstring_examples import run_examples

PIECES = [
    "tether.transforms.KLRewardTransform",
    "tether.llm.KLRewardTransform",
    "tether.llm.RetrieveLogProb",
    "tether.llm.KLComputation",
    "tether.llm.RetrieveKL",
    "tether.llm.answer_sums",
    "tether.objectives.GRPOLoss",
    "tether.objectives.MCAdvantage",
    "tether.rollout.RolloutFromModel",
    "tether.control.ConstantKLController",
    "tether.control.AdaptiveKLController",
    "tether.control.TargetKLController",
    "tether.control.BudgetKLController",
    "tether.control.make_kl_controller",
]


@pytest.mark.parametrize("dotted", PIECES)
def test_docstring_examples_run(dotted):
    run_examples(dotted)


def test_a_piece_without_examples_fails():
    """The collector refuses a listed piece whose docstring holds no example."""
    with pytest.raises(AssertionError, match="no Examples section"):
        run_examples("tether.llm.chat_batch")
