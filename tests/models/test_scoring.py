"""Padding-free scoring: parity with full-logit scoring, causality, layout invariance, grads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tether.models.scoring import plan_micro_batches, row_spans, score_tokens
from tests.helpers import make_tiny_model, make_tokenizer


def naive_row_logprobs(model, row: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(x_t | x_<t) for one unpadded row from the full logits; position 0 is 0."""
    logits = model(input_ids=row[None]).logits[0].double() / temperature
    lp = F.log_softmax(logits[:-1], dim=-1).gather(-1, row[1:, None]).squeeze(-1)
    return torch.cat([lp.new_zeros(1), lp])


def naive_row_entropy(model, row: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=row[None]).logits[0].double()[:-1]
    ent = torch.distributions.Categorical(logits=logits).entropy()
    return torch.cat([ent.new_zeros(1), ent])


def ragged_batch(lengths, vocab=256, seed=0, padding_side="left", extra=0, pad=259):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths) + extra
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    rows = []
    for i, n in enumerate(lengths):
        row = torch.randint(0, vocab, (n,), generator=g)
        rows.append(row)
        sl = slice(width - n, width) if padding_side == "left" else slice(0, n)
        ids[i, sl] = row
        mask[i, sl] = True
    return ids, mask, rows


@pytest.fixture
def model64():
    return make_tiny_model(make_tokenizer(), dtype=torch.float64)


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("budget", [1, 20, 4096])
def test_matches_full_logits_per_row(model64, padding_side, budget):
    """Each valid position equals log_softmax(full logits)[label] of the row scored alone."""
    ids, mask, rows = ragged_batch([7, 1, 12, 3, 9], padding_side=padding_side, extra=2)
    out = score_tokens(model64, ids, mask, token_budget=budget).log_probs
    for i, row in enumerate(rows):
        expected = naive_row_logprobs(model64, row)
        torch.testing.assert_close(out[i][mask[i]].double(), expected, rtol=0, atol=1e-10)
    assert torch.all(out[~mask] == 0)


def test_temperature_and_entropy(model64):
    ids, mask, rows = ragged_batch([6, 10, 4], padding_side="left")
    stats = score_tokens(model64, ids, mask, temperature=0.5, with_entropy=True)
    ent = score_tokens(model64, ids, mask, with_entropy=True).entropy
    for i, row in enumerate(rows):
        torch.testing.assert_close(stats.log_probs[i][mask[i]].double(), naive_row_logprobs(model64, row, 0.5),
                                   rtol=0, atol=1e-10)
        torch.testing.assert_close(ent[i][mask[i]].double(), naive_row_entropy(model64, row), rtol=0, atol=1e-10)


def test_no_future_leakage(model64):
    """Changing token k changes no log-prob at positions < k, in any micro-batch layout."""
    ids, mask, _ = ragged_batch([10, 10, 10], padding_side="right")
    base = score_tokens(model64, ids, mask, token_budget=30).log_probs
    for k in (3, 7, 9):
        changed = ids.clone()
        changed[:, k] = (changed[:, k] + 17) % 256
        out = score_tokens(model64, changed, mask, token_budget=30).log_probs
        torch.testing.assert_close(out[:, :k], base[:, :k], rtol=0, atol=0)
        assert not torch.equal(out[:, k], base[:, k])


def test_layout_invariance(model64):
    """Left, right and extra padding give the same values row by row (exact in float64)."""
    lengths = [5, 11, 2, 8]
    left = ragged_batch(lengths, padding_side="left")
    right = ragged_batch(lengths, padding_side="right", extra=5)
    a = score_tokens(model64, left[0], left[1]).log_probs
    b = score_tokens(model64, right[0], right[1]).log_probs
    for i in range(len(lengths)):
        torch.testing.assert_close(a[i][left[1][i]], b[i][right[1][i]], rtol=0, atol=1e-12)


def test_gradients_match_full_logits():
    """Gradients w.r.t. every parameter equal those of the full-logit computation."""
    model = make_tiny_model(make_tokenizer(), dtype=torch.float64)
    ids, mask, rows = ragged_batch([6, 9, 3], padding_side="left")
    weights = torch.randn(ids.shape, dtype=torch.float64)
    out = score_tokens(model, ids, mask, token_budget=9).log_probs
    (out.double() * weights).sum().backward()
    fast = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total = 0
    for i, row in enumerate(rows):
        total = total + (naive_row_logprobs(model, row) * weights[i][mask[i]]).sum()
    total.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(fast[n], p.grad, rtol=1e-9, atol=1e-11, msg=n)


def test_peft_model_scores_through_adapter():
    peft = pytest.importorskip("peft")
    model = make_tiny_model(make_tokenizer(), dtype=torch.float64)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ids, mask, rows = ragged_batch([5, 8], padding_side="left")
    out = score_tokens(lora, ids, mask).log_probs
    for i, row in enumerate(rows):
        logits = lora(input_ids=row[None]).logits[0, :-1]
        expected = F.log_softmax(logits, -1).gather(-1, row[1:, None]).squeeze(-1)
        torch.testing.assert_close(out[i][mask[i]][1:].double(), expected, rtol=0, atol=1e-10)


def test_plan_covers_every_row_once():
    lengths = torch.tensor([3, 50, 7, 7, 1, 20])
    groups = plan_micro_batches(lengths, token_budget=21)
    flat = torch.cat(groups)
    assert sorted(flat.tolist()) == list(range(6))
    for g in groups:
        assert len(g) == 1 or len(g) * int(lengths[g].max()) <= 21


def test_errors():
    model = make_tiny_model(make_tokenizer())
    ids = torch.zeros(2, 4, dtype=torch.long)
    holes = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="attention_mask.*holes"):
        row_spans(holes)
    with pytest.raises(ValueError, match="tokens/attention_mask"):
        score_tokens(model, ids, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="token_budget"):
        score_tokens(model, ids, torch.ones(2, 4, dtype=torch.bool), token_budget=0)
    with pytest.raises(TypeError, match="model"):
        score_tokens(torch.nn.Linear(2, 2), ids, torch.ones(2, 4, dtype=torch.bool))
