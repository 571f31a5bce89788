"""PromptBatch: the prompt-only view, the reference view, and every validation error."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.builders import prompt_batch
from tether.rollout import LABEL_IGNORE_INDEX, PromptBatch

PAD = 259


def test_mask_label_keeps_exactly_the_prompt():
    batch = prompt_batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], pad=PAD)
    prompt = batch.mask_label(0)
    assert prompt.input_ids.tolist() == [[1, 2, 3, 0, 0], [4, 0, 0, 0, 0]]
    assert prompt.attention_mask.tolist() == [[True] * 3 + [False] * 2, [True] + [False] * 4]
    assert prompt.labels is None and torch.equal(prompt.prompt_rindex, batch.prompt_rindex)


def test_reference_view_with_labels_replaces_what_follows_the_prompt():
    """Labels win over the ids after the prompt; without labels the row is kept as given."""
    ids = torch.tensor([[1, 2, 30, 31, PAD], [4, PAD, PAD, PAD, PAD]])
    mask = ids != PAD
    labels = torch.full_like(ids, LABEL_IGNORE_INDEX)
    labels[0, 2:5] = torch.tensor([5, 6, 7])
    labels[1, 1:3] = torch.tensor([8, 9])
    batch = PromptBatch.from_tensors(ids, mask, torch.tensor([2, 1]), labels)
    ref = batch.reference_view()
    assert ref.input_ids[ref.attention_mask].tolist() == [1, 2, 5, 6, 7, 4, 8, 9]
    assert ref.attention_mask.sum(-1).tolist() == [5, 3]
    plain = PromptBatch.from_tensors(ids, mask, torch.tensor([2, 1]))
    assert plain.reference_view() is plain


def test_labels_equal_to_input_ids_as_torchrl_prompt_data_carries_them():
    """TorchRL's PromptData sets labels = input_ids (pad ids included). Row 0 (prompt 1, 2;
    completion 30, 31) in that layout, row 1 (prompt 4) in the Hugging Face layout with
    completion 8, 9: the reference view is [1, 2, 30, 31] and [4, 8, 9]."""
    ids = torch.tensor([[1, 2, 30, 31, PAD], [4, PAD, PAD, PAD, PAD]])
    mask = ids != PAD
    labels = ids.clone()
    labels[1] = torch.tensor([LABEL_IGNORE_INDEX, 8, 9, LABEL_IGNORE_INDEX, LABEL_IGNORE_INDEX])
    ref = PromptBatch.from_tensors(ids, mask, torch.tensor([2, 1]), labels).reference_view()
    assert ref.input_ids[ref.attention_mask].tolist() == [1, 2, 30, 31, 4, 8, 9]
    assert ref.attention_mask.sum(-1).tolist() == [4, 3]
    whole = PromptBatch.from_tensors(ids, mask, torch.tensor([2, 1]), ids.clone()).reference_view()
    assert whole.input_ids[whole.attention_mask].tolist() == [1, 2, 30, 31, 4]
    wrong_prompt = ids.clone()
    wrong_prompt[0, 1] = 99
    with pytest.raises(ValueError, match=r"labels: rows \[0\] carry label ids on the prompt .* differ from input_ids"):
        PromptBatch.from_tensors(ids, mask, torch.tensor([2, 1]), wrong_prompt)


def test_integer_attention_mask_is_accepted_as_bool():
    ids = torch.tensor([[1, 2, PAD]])
    batch = PromptBatch.from_tensors(ids, torch.tensor([[1, 1, 0]]), torch.tensor([2]))
    assert batch.attention_mask.dtype == torch.bool


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"input_ids": torch.zeros(2, 3)}, TypeError, "input_ids: expected an integer tensor"),
        ({"attention_mask": torch.ones(2, 4, dtype=torch.bool)}, ValueError, "attention_mask: expected a tensor of the shape"),
        ({"attention_mask": torch.full((2, 3), 2)}, ValueError, "attention_mask: expected bool or 0/1"),
        ({"prompt_rindex": torch.tensor([1.0, 1.0])}, TypeError, "prompt_rindex: expected an integer tensor"),
        ({"prompt_rindex": torch.tensor([0, 1])}, ValueError, r"rows \[0\]"),
        ({"prompt_rindex": torch.tensor([1, 3])}, ValueError, r"rows \[1\] have prompt_rindex \[3\]"),
        ({"prompt_rindex": torch.tensor([1, 1, 1])}, ValueError, "prompt_rindex: expected an integer tensor of shape"),
        ({"attention_mask": torch.tensor([[0, 1, 1], [1, 1, 0]])}, ValueError, r"right padding.*rows \[0\]"),
        ({"labels": torch.tensor([[5, -100, -100], [-100, -100, -100]])}, ValueError, r"labels: .*rows \[0\]"),
        ({"labels": torch.tensor([[-100, -100, 5], [-100, -100, -100]])}, ValueError, r"labels: .*rows \[0\]"),
        ({"labels": torch.full((2, 2), -100)}, ValueError, "labels: expected the shape of input_ids"),
    ],
)
def test_validation_errors_name_the_field(kwargs, error, match):
    fields = {
        "input_ids": torch.tensor([[1, 2, 3], [4, 5, PAD]]),
        "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "prompt_rindex": torch.tensor([1, 2]),
        "labels": None,
    }
    fields.update(kwargs)
    with pytest.raises(error, match=match):
        PromptBatch.from_tensors(**fields)


def test_validate_catches_a_wrong_batch_size():
    ids = torch.tensor([[1, 2], [3, 4]])
    batch = PromptBatch(input_ids=ids, attention_mask=ids > 0, prompt_rindex=torch.tensor([1, 1]), batch_size=[])
    with pytest.raises(ValueError, match="batch_size: expected"):
        batch.validate()
