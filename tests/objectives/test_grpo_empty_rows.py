"""A row with an empty loss mask in GRPOLoss: a defined, tested behaviour (issue 14).

An empty row is legitimate for the loss (a caller may mask out a whole response on
purpose, e.g. DAPO's overlong filtering), so GRPOLoss does not refuse it: the row is left
out of every term, as ``tether.ops.aggregate`` documents (it neither adds a zero nor counts
in a sequence mean). Where an empty row is a mistake, a chat without an assistant turn, it
is refused earlier, by assistant-only scoring (``tether.llm.RetrieveLogProb``).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.objectives.test_grpo_masks import actor, assert_same, base_batch, full_loss, outputs_and_grad

__all__ = ["actor"]  # the module-scoped fixture, re-used


def _with_empty_row(td: TensorDict) -> TensorDict:
    """``td`` plus a last row of real tokens whose loss mask is all False; its log-probs
    outside the mask are NaN and its advantage is large, so any leak would show."""
    width = td["tokens", "full"].shape[1]
    extra = {
        ("tokens", "full"): torch.arange(10, 10 + width)[None],
        ("masks", "all_attention_mask"): torch.ones(1, width, dtype=torch.bool),
        ("masks", "all_assistant_mask"): torch.zeros(1, width, dtype=torch.bool),
        ("log_probs", "full"): torch.full((1, width), float("nan"), dtype=torch.float64),
        ("ref_log_probs", "full"): torch.full((1, width), float("nan"), dtype=torch.float64),
        "advantage": torch.tensor([5.0], dtype=torch.float64),
    }
    out = TensorDict(batch_size=[td.batch_size[0] + 1])
    for key, value in extra.items():
        out[key] = torch.cat([td[key], value])
    return out


@pytest.mark.parametrize(
    "aggregation, normalizer",
    [("token-mean", None), ("seq-mean-token-mean", None), ("seq-mean-token-sum", None),
     ("seq-mean-token-sum-norm", 4.0)],
)
def test_empty_row_changes_no_output_and_no_gradient(actor, aggregation, normalizer):
    """Every reported value and the gradient equal those of the batch without the row (so
    a seq-mean divides by 2 rows, not 3)."""
    loss = full_loss(actor, aggregation=aggregation, normalizer=normalizer, entropy_bonus=True)
    base = base_batch(actor)
    want, want_grad = outputs_and_grad(loss, base)
    got, got_grad = outputs_and_grad(loss, _with_empty_row(base))
    assert_same(got, want)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-11)
