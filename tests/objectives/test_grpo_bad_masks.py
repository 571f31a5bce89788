"""GRPO inputs: masks are bool or exact 0/1 integers, token ids are integers (issue 14)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tether.objectives.grpo_inputs import GRPOKeys, read_grpo_batch


def _td(overrides: dict | None = None) -> TensorDict:
    entries = {
        ("tokens", "full"): torch.tensor([[5, 6, 7, 8]]),
        ("masks", "all_attention_mask"): torch.ones(1, 4, dtype=torch.bool),
        ("masks", "all_assistant_mask"): torch.tensor([[False, False, True, True]]),
        ("log_probs", "full"): torch.zeros(1, 4),
        "advantage": torch.ones(1),
    }
    entries.update(overrides or {})
    return TensorDict(entries, batch_size=[1])


def _read(td: TensorDict):
    return read_grpo_batch(td, GRPOKeys(), with_ref=False, with_old=False)


def test_float_loss_mask_is_refused_not_binarised():
    """Before: 0.3 counted as 1 (``.bool()``); now float masks raise, like attention masks."""
    td = _td({("masks", "all_assistant_mask"): torch.tensor([[0.0, 0.0, 0.3, 1.0]])})
    with pytest.raises(TypeError, match=r"'all_assistant_mask'.*bool \(or 0/1 integer\) mask.*float32.*> 0.5"):
        _read(td)


def test_integer_masks_must_be_exactly_zero_or_one():
    good = _read(_td({("masks", "all_assistant_mask"): torch.tensor([[0, 0, 1, 1]])}))
    assert good.mask.tolist() == [[False, False, True, True]]
    with pytest.raises(ValueError, match=r"'all_assistant_mask'.*only 0 and 1, got values in \[0, 2\]"):
        _read(_td({("masks", "all_assistant_mask"): torch.tensor([[0, 0, 2, 1]])}))
    with pytest.raises(TypeError, match=r"'all_attention_mask'.*float"):
        _read(_td({("masks", "all_attention_mask"): torch.ones(1, 4)}))


def test_float_token_ids_are_refused_not_truncated():
    """Before: 5.7 became token 5 (``.long()``)."""
    with pytest.raises(TypeError, match=r"\('tokens', 'full'\) must be an integer tensor.*float32"):
        _read(_td({("tokens", "full"): torch.tensor([[5.0, 6.7, 7.0, 8.0]])}))


def test_mask_on_another_device_is_named():
    """A loss mask on another device (meta here) is a ValueError naming both devices."""
    td = _td({("masks", "all_assistant_mask"): torch.zeros(1, 4, dtype=torch.bool, device="meta")})
    with pytest.raises(ValueError, match=r"'all_assistant_mask'.*is on meta but.*cpu.*\.to\("):
        _read(td)
