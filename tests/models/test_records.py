"""``StepRecord``: rows cut alike (the reference's hidden states included), the TensorDict
edge in both directions, and refused shapes."""

from __future__ import annotations

import pytest
import torch

from tether.models.records import HeadHidden, StepRecord, TD_KEYS


def _record() -> StepRecord:
    """3 rows of 5 tokens; answers of 2, 0 and 3 tokens, so the hidden rows are 2 + 0 + 3."""
    tokens = torch.arange(15).reshape(3, 5)
    attn = torch.ones(3, 5, dtype=torch.bool)
    answer = torch.zeros(3, 5, dtype=torch.bool)
    answer[0, 3:], answer[2, 2:] = True, True
    hidden = HeadHidden(torch.arange(5.0)[:, None].expand(5, 4), torch.zeros(7, 4))
    return StepRecord(tokens, attn, answer, torch.tensor([0, 0, 1]), torch.full((3, 5), -0.5) * answer,
                      responses=["a", "", "ccc"], ref_log_probs=torch.full((3, 5), -0.25) * answer,
                      ref_hidden=hidden, rewards=torch.tensor([1.0, 0.0, 2.0]),
                      episode={"turns": torch.tensor([1, 2, 3])})


def test_rows_cut_every_field_and_the_hidden_states_by_answer_counts():
    """Rows 1:3 hold 0 + 3 answer tokens: hidden rows 2, 3, 4 (row 0's two come first)."""
    part = _record().rows(1, 3)
    assert part.tokens.tolist() == _record().tokens[1:3].tolist() and part.responses == ["", "ccc"]
    assert part.ref_hidden.hidden[:, 0].tolist() == [2.0, 3.0, 4.0]
    assert part.rewards.tolist() == [0.0, 2.0] and part.episode["turns"].tolist() == [2, 3]
    assert part.group_ids.tolist() == [0, 1] and part.advantages is None


def test_sequence_log_ratio_is_the_k1_sum_over_answers():
    """Per answer token -0.5 - (-0.25) = -0.25: rows of 2, 0, 3 tokens give -0.5, 0, -0.75."""
    assert _record().sequence_log_ratio().tolist() == [-0.5, 0.0, -0.75]


def test_the_tensordict_edge_round_trips():
    record = _record()
    td = record.to_tensordict()
    assert torch.equal(td[TD_KEYS["assistant_mask"]], record.assistant_mask)
    back = StepRecord.from_tensordict(td, group_ids=record.group_ids)
    for name in ("tokens", "attention_mask", "assistant_mask", "sample_log_probs", "ref_log_probs"):
        assert torch.equal(getattr(back, name), getattr(record, name)), name
    assert torch.equal(back.episode["turns"], record.episode["turns"])


def test_refused_inputs_name_the_field():
    r = _record()
    with pytest.raises(ValueError, match=r"StepRecord.assistant_mask: expected the tokens' shape \(3, 5\)"):
        StepRecord(r.tokens, r.attention_mask, r.assistant_mask[:, :4], r.group_ids, r.sample_log_probs)
    with pytest.raises(TypeError, match="StepRecord.attention_mask: expected a bool mask"):
        StepRecord(r.tokens, r.attention_mask.long(), r.assistant_mask, r.group_ids, r.sample_log_probs)
    with pytest.raises(ValueError, match=r"StepRecord.group_ids: expected \[3\]"):
        StepRecord(r.tokens, r.attention_mask, r.assistant_mask, r.group_ids[:2], r.sample_log_probs)
    with pytest.raises(KeyError, match="rollout: missing"):
        StepRecord.from_tensordict(r.to_tensordict().exclude(TD_KEYS["sample_log_probs"]), group_ids=r.group_ids)
    with pytest.raises(ValueError, match="StepRecord.ref_log_probs is None"):
        StepRecord(r.tokens, r.attention_mask, r.assistant_mask, r.group_ids, r.sample_log_probs).sequence_log_ratio()
