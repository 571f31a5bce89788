"""TorchRL 0.14.1's keywords of ``GRPOLoss`` and ``MCAdvantage``: accepted with TorchRL's meaning,
or refused by name with the change to make (docs/torchrl.md's table lists each)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tether.models.batch_io import write_objects
from tether.objectives import GRPOLoss, MCAdvantage
from tests.objectives.helpers import make_batch, tiny_wrapper, two_row_grid


@pytest.fixture(scope="module")
def actor():
    return tiny_wrapper()


@pytest.fixture(scope="module")
def batch(actor):
    tokens, attention, loss_mask = two_row_grid()
    return make_batch(actor, tokens, attention, loss_mask, torch.tensor([1.0, -2.0]))


def test_generic_masking_trains_on_every_valid_token(actor, batch):
    """``"generic"`` is TorchRL's attention masking: every valid token that has a prediction, i.e.
    the attention mask without each row's first token (9 of the grid's 11 valid tokens), equal
    to a loss mask built so by hand; the default trains on the 5 assistant tokens only."""
    tokens, attention, _ = two_row_grid()
    by_hand_mask = attention.clone()
    by_hand_mask[0, 0] = by_hand_mask[1, 1] = False
    assert int(by_hand_mask.sum()) == 9
    by_hand = batch.clone()
    by_hand["predicted"] = by_hand_mask
    loss = GRPOLoss(actor, masking_strategy="generic")
    assert loss.tensor_keys.loss_mask is None and ("masks", "all_assistant_mask") not in loss.in_keys
    generic = loss(batch)
    expected = GRPOLoss(actor).set_keys(loss_mask="predicted")(by_hand)
    default = GRPOLoss(actor)(batch)
    torch.testing.assert_close(generic.loss_objective, expected.loss_objective, rtol=0, atol=0)
    torch.testing.assert_close(generic.entropy, expected.entropy, rtol=0, atol=0)
    assert not torch.allclose(generic.entropy, default.entropy)


@pytest.mark.parametrize("strategy", ["sft", "rlhf"])
def test_sft_and_rlhf_masking_train_on_the_assistant_tokens(actor, batch, strategy):
    out, default = GRPOLoss(actor, masking_strategy=strategy)(batch), GRPOLoss(actor)(batch)
    torch.testing.assert_close(out.loss_objective, default.loss_objective, rtol=0, atol=0)
    torch.testing.assert_close(out.entropy, default.entropy, rtol=0, atol=0)


def test_an_unknown_masking_strategy_lists_the_three(actor):
    with pytest.raises(ValueError, match=r"masking_strategy: expected one of 'sft', 'rlhf', 'generic', got 'prompt'"):
        GRPOLoss(actor, masking_strategy="prompt")


def test_reduction_mean_is_torchrls_default_and_changes_nothing(actor, batch):
    out, default = GRPOLoss(actor, reduction="mean")(batch), GRPOLoss(actor)(batch)
    torch.testing.assert_close(out.loss_objective, default.loss_objective, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_other_reductions_are_refused_with_the_change(actor, reduction):
    with pytest.raises(TypeError, match=rf"reduction='{reduction}' is not supported.*Drop it.*token_terms"):
        GRPOLoss(actor, reduction=reduction)


def test_the_kl_mask_threshold_is_refused_by_name(actor):
    GRPOLoss(actor, kl_mask_threshold=None)
    with pytest.raises(TypeError, match=r"kl_mask_threshold=0\.5 .*not supported; drop it"):
        GRPOLoss(actor, kl_mask_threshold=0.5)


def _one_step(prompt_key: str, prompts: list[str], rewards: list[float]) -> TensorDict:
    n = len(prompts)
    td = TensorDict({("next", "reward"): torch.tensor(rewards, dtype=torch.float64).reshape(n, 1),
                     ("next", "done"): torch.ones(n, 1, dtype=torch.bool)}, batch_size=[n])
    write_objects(td, prompt_key, prompts)
    return td


def test_trajectory_return_only_its_default(actor):
    MCAdvantage(2, trajectory_return=None)
    with pytest.raises(TypeError, match=r"trajectory_return='sum' .*not supported; drop it"):
        MCAdvantage(2, trajectory_return="sum")


def test_a_query_keyed_batch_names_torchrls_prompt_key():
    """TorchRL 0.14 groups by ``"query"``; the seed's default ``"text"`` is kept, and a batch that has
    only ``"query"`` says which argument to pass. With it, the group's advantages are +-1/sqrt(2)
    (rewards 1 and 0: mean 0.5, Bessel spread sqrt(1/2))."""
    td = _one_step("query", ["p", "p"], [1.0, 0.0])
    with pytest.raises(KeyError, match=r"prompt_key='query'"):
        MCAdvantage(2).add(td)
    out = MCAdvantage(2, prompt_key="query").add(td)
    expected = torch.tensor([0.5, -0.5], dtype=torch.float64) / (0.5 ** 0.5 + 1e-6)
    torch.testing.assert_close(out["advantage"].reshape(-1), expected, rtol=0, atol=1e-12)
