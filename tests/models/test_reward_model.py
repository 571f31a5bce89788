"""SequenceRewardModel: per-token and end scores, whatever the padding side, pad == eos included."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2ForSequenceClassification, LlamaForSequenceClassification

from tests.helpers import make_tiny_model, make_tokenizer
from tether.models import RewardOutput, SequenceRewardModel
from tests.helpers import make_tiny_classifier

PAD, EOS = 259, 258
ROWS = [[257, 72, 105, 33, 258], [257, 200, 3, 258, 10, 65, 66, 258], [257, 9]]


def classifier(*, pad_token_id=PAD, num_labels=1, seed=0) -> LlamaForSequenceClassification:
    return make_tiny_classifier(pad_token_id=pad_token_id, eos_token_id=EOS, num_labels=num_labels,
                                seed=seed, max_positions=64)


def pad(rows, value, side):
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(0, len(row)) if side == "right" else slice(width - len(row), width)
        ids[i, span] = torch.tensor(row)
        mask[i, span] = 1
    return ids, mask


def alone(rm: SequenceRewardModel, row) -> RewardOutput:
    ids = torch.tensor([row])
    with torch.no_grad():
        return rm(ids, torch.ones_like(ids))


def test_end_score_matches_hf_pooling_when_its_pad_detection_is_right():
    model = classifier()
    rm = SequenceRewardModel(model)
    ids, mask = pad(ROWS, PAD, "right")
    with torch.no_grad():
        out = rm(ids, mask)
        hf = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    torch.testing.assert_close(out.end_scores, hf, atol=1e-6, rtol=1e-6)
    assert out.end_index.tolist() == [4, 7, 1]
    assert torch.equal(out.end_scores, out.token_scores[torch.arange(3), out.end_index])
    assert torch.equal(out.token_scores[mask == 0], torch.zeros(int((mask == 0).sum())))


def test_token_scores_are_the_head_on_each_prefix():
    """The model is causal, so the score at position t equals HF's pooled score of ids[:t+1]."""
    model = classifier()
    rm = SequenceRewardModel(model)
    row = ROWS[1]
    out = alone(rm, row)
    with torch.no_grad():
        prefixes = [model(input_ids=torch.tensor([row[: t + 1]])).logits[0, 0] for t in range(len(row))]
    torch.testing.assert_close(out.token_scores[0], torch.stack(prefixes), atol=1e-5, rtol=1e-5)


def test_left_and_right_padding_give_the_same_scores():
    rm = SequenceRewardModel(classifier())
    with torch.no_grad():
        right = rm(*pad(ROWS, PAD, "right"))
        left_ids, left_mask = pad(ROWS, PAD, "left")
        left = rm(left_ids, left_mask.bool())
    torch.testing.assert_close(left.end_scores, right.end_scores, atol=1e-5, rtol=1e-5)
    for i, row in enumerate(ROWS):
        single = alone(rm, row)
        torch.testing.assert_close(right.token_scores[i, : len(row)], single.token_scores[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(left.token_scores[i, -len(row) :], single.token_scores[0], atol=1e-5, rtol=1e-5)
    assert left.end_index.tolist() == [7, 7, 7]


def test_position_ids_follow_the_mask_for_absolute_position_models():
    """RoPE (Llama) hides a position offset; GPT-2's learned absolute positions do not, so a
    left-padded row only matches its unpadded score if positions restart at its first token."""
    config = GPT2Config(
        vocab_size=260, n_embd=32, n_layer=2, n_head=4, n_positions=64, num_labels=1, pad_token_id=PAD
    )
    torch.manual_seed(0)
    rm = SequenceRewardModel(GPT2ForSequenceClassification(config).eval())
    with torch.no_grad():
        left = rm(*pad(ROWS, PAD, "left"))
    expected = torch.stack([alone(rm, row).end_scores[0] for row in ROWS])
    torch.testing.assert_close(left.end_scores, expected, atol=1e-5, rtol=1e-5)


def test_pad_equal_to_eos_keeps_the_closing_eos():
    """With pad == eos HF takes the rightmost non-eos token, i.e. the one before the closing
    eos; tether scores the eos itself, read from the attention mask."""
    model = classifier(pad_token_id=EOS)
    rm = SequenceRewardModel(model)
    ids, mask = pad(ROWS[:2], EOS, "right")
    with torch.no_grad():
        out = rm(ids, mask)
        hf = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    expected = torch.stack([alone(rm, row).end_scores[0] for row in ROWS[:2]])
    torch.testing.assert_close(out.end_scores, expected, atol=1e-5, rtol=1e-5)
    assert out.end_index.tolist() == [4, 7]
    assert (hf - out.end_scores).abs().min() > 1e-4, "HF's own pooling misses the eos here"


def test_score_texts_pads_with_the_tokenizer_pad_id():
    tok = make_tokenizer()
    rm = SequenceRewardModel(classifier(pad_token_id=None), tok)
    assert rm.pad_token_id == PAD
    texts = ["a short one", "a much longer text to score"]
    with torch.no_grad():
        out = rm.score_texts(texts)
        singles = [rm.score_texts([t]).end_scores[0] for t in texts]
    torch.testing.assert_close(out.end_scores, torch.stack(singles), atol=1e-5, rtol=1e-5)
    assert out.end_index.tolist() == [len(texts[0]) - 1, len(texts[1]) - 1]


def test_pad_id_precedence():
    assert SequenceRewardModel(classifier(pad_token_id=7)).pad_token_id == 7
    assert SequenceRewardModel(classifier(pad_token_id=7), make_tokenizer()).pad_token_id == PAD
    assert SequenceRewardModel(classifier(), make_tokenizer(), pad_token_id=3).pad_token_id == 3


def test_state_dict_lists_the_head_once():
    keys = list(SequenceRewardModel(classifier()).state_dict())
    assert [k for k in keys if "score" in k] == ["model.score.weight"]


def test_model_without_score_head_is_refused():
    with pytest.raises(TypeError, match="no linear `score` head"):
        SequenceRewardModel(make_tiny_model())


def test_multi_label_head_is_refused():
    with pytest.raises(ValueError, match="2 outputs, expected 1.*num_labels=1"):
        SequenceRewardModel(classifier(num_labels=2))


@pytest.mark.parametrize(
    ("ids", "mask", "error", "pattern"),
    [
        (torch.ones(2, 3), torch.ones(2, 3), TypeError, r"input_ids must be an integer tensor \[B, T\]"),
        (torch.ones(3, dtype=torch.long), torch.ones(3), TypeError, "input_ids must be an integer tensor"),
        (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4), ValueError, r"same shape as input_ids \(2, 3\)"),
        (torch.ones(2, 3, dtype=torch.long), None, ValueError, "attention_mask must be a tensor"),
        (torch.ones(2, 3, dtype=torch.long), torch.full((2, 3), 2), ValueError, "only 0/1"),
        (torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [0, 0, 0]]), ValueError, r"rows \[1\]"),
    ],
)
def test_bad_batch_is_refused(ids, mask, error, pattern):
    with pytest.raises(error, match=pattern):
        SequenceRewardModel(classifier())(ids, mask)


def test_score_texts_errors():
    with pytest.raises(ValueError, match="needs a tokenizer"):
        SequenceRewardModel(classifier()).score_texts(["x"])
    rm = SequenceRewardModel(classifier(), make_tokenizer())
    with pytest.raises(TypeError, match=r"wrap a single text as \[text\]"):
        rm.score_texts("x")
    with pytest.raises(ValueError, match="texts is empty"):
        rm.score_texts([])
    tok = make_tokenizer()
    tok.pad_token = None
    with pytest.raises(ValueError, match="pad_token_id: none given.*Pass pad_token_id=<id> to SequenceRewardModel"):
        SequenceRewardModel(classifier(pad_token_id=None), tok).score_texts(["x"])
    with pytest.raises(ValueError, match="pad_token_id: expected an int >= 0, got -1"):  # special_ids' check
        SequenceRewardModel(classifier(), pad_token_id=-1)
