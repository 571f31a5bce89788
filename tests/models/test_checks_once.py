"""A scoring call checks its inputs once: ``row_spans`` (the contiguity check, a host read) runs
once per ``score_tokens`` / ``exact_kl_tokens`` call whichever path scores it, the values equal
a naive float64 reference, and every input error still reaches the caller of either entry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tether.models.packing as packing
import tether.models.score_plan as score_plan
import tether.models.scoring as scoring
from tether.models.scoring import exact_kl_tokens, score_tokens
from tests.helpers import make_tiny_model, make_tokenizer


@pytest.fixture(scope="module")
def models():
    tok = make_tokenizer()
    return make_tiny_model(tok, dtype=torch.float64, seed=0), make_tiny_model(tok, dtype=torch.float64, seed=1)


@pytest.fixture
def span_checks(monkeypatch):
    """Counts calls of ``row_spans``, the one function that checks a mask's rows, under every name a
    scoring module holds it by."""
    calls: list[tuple[int, ...]] = []
    original = score_plan.row_spans

    def counted(mask):
        calls.append(tuple(mask.shape))
        return original(mask)

    for module in (score_plan, packing, scoring):
        monkeypatch.setattr(module, "row_spans", counted, raising=False)
    return calls


def _grpo_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 6 tokens, three left-padded answers each (2 to 4 tokens): shared prefixes,
    several lengths, so the packed, micro-batch and shared-prefix passes all have work."""
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(4, 250, (2, 6), generator=g)
    rows, width = [], 10
    for prompt in prompts:
        for answer in (2, 3, 4):
            row = torch.cat([prompt, torch.randint(4, 250, (answer,), generator=g)])
            rows.append(F.pad(row, (width - row.numel(), 0)))
    tokens = torch.stack(rows)
    lengths = torch.tensor([8, 9, 10, 8, 9, 10])
    mask = torch.arange(width)[None, :] >= (width - lengths)[:, None]
    return tokens, mask


def _naive_log_probs(model, tokens, mask) -> torch.Tensor:
    """log p(x_t | x_<t) of each unpadded row from the model's own float64 logits; 0 elsewhere."""
    out = torch.zeros(tokens.shape, dtype=torch.float64)
    for b in range(tokens.shape[0]):
        row = tokens[b][mask[b]]
        with torch.no_grad():
            logp = F.log_softmax(model(input_ids=row[None]).logits[0, :-1].double(), -1)
        cols = mask[b].nonzero().flatten()[1:]
        out[b, cols] = logp.gather(-1, row[1:, None]).squeeze(-1)
    return out


@pytest.mark.parametrize("options", [{}, {"share_prefix": True}, {"token_budget": 12}, {"with_entropy": True}],
                         ids=["packed", "shared-prefix", "micro-batches", "entropy"])
def test_row_spans_runs_once_per_score_tokens_call(models, span_checks, options):
    """Before: up to four runs on one mask (the shared-prefix planner, the packed pass and each packed
    micro-batch). The values are the naive ones, so the single check feeds every pass correctly."""
    policy, _ = models
    tokens, mask = _grpo_batch()
    got = score_tokens(policy, tokens, mask, **options).log_probs
    assert span_checks == [tuple(mask.shape)]
    torch.testing.assert_close(got.double(), _naive_log_probs(policy, tokens, mask), rtol=0, atol=1e-10)


def test_row_spans_runs_once_on_the_micro_batch_path(span_checks):
    """A checkpointed decoder in grad mode is scored in right-padded micro-batches (no packing, no
    shared prefix); the gradient flows and the values are the naive ones."""
    model = make_tiny_model(make_tokenizer(), dtype=torch.float64, seed=2)
    model.gradient_checkpointing_enable()
    model.train()
    tokens, mask = _grpo_batch()
    got = score_tokens(model, tokens, mask, token_budget=20, share_prefix=True).log_probs
    assert span_checks == [tuple(mask.shape)]
    got.sum().backward()
    assert model.lm_head.weight.grad is not None
    model.eval()
    torch.testing.assert_close(got.detach().double(), _naive_log_probs(model, tokens, mask), rtol=0, atol=1e-10)


def test_exact_kl_tokens_checks_once_for_both_passes(models, span_checks):
    """Before: once in ``exact_kl_tokens`` and again in each of its two ``score_tokens`` calls."""
    policy, reference = models
    tokens, mask = _grpo_batch()
    kl = exact_kl_tokens(policy, reference, tokens, mask)
    assert span_checks == [tuple(mask.shape)]
    assert bool((kl[~mask] == 0).all()) and bool((kl[mask].sum() > 0))


def test_exact_kl_tokens_reports_every_input_error(models):
    """The errors ``score_tokens`` gives reach ``exact_kl_tokens``'s caller: a row with holes, shapes
    that differ, float ids, a zero budget, and ids past the reference's vocabulary (only the
    reference is too small here, so only its own check can catch them)."""
    policy, reference = models
    tokens, mask = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool)
    holes = torch.tensor([[True, False, True, True], [True, True, True, True]])
    with pytest.raises(ValueError, match=r"attention_mask: expected each row to be one contiguous run.*rows \[0\]"):
        exact_kl_tokens(policy, reference, tokens, holes)
    with pytest.raises(ValueError, match=r"tokens/attention_mask: expected two \[B, T\] tensors.*\(2, 4\) and \(2, 3\)"):
        exact_kl_tokens(policy, reference, tokens, mask[:, :3])
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        exact_kl_tokens(policy, reference, tokens.float(), mask)
    with pytest.raises(ValueError, match="token_budget"):
        exact_kl_tokens(policy, reference, tokens, mask, token_budget=0)
    small = make_tiny_model(make_tokenizer(), dtype=torch.float64)
    small.resize_token_embeddings(100)
    with pytest.raises(ValueError, match=r"tokens: ids must lie in \[0, 100\).*span \[5, 200\]"):
        exact_kl_tokens(policy, small, torch.tensor([[5, 6, 200]]), torch.ones(1, 3, dtype=torch.bool))


def test_score_tokens_reports_holes_before_any_pass(models):
    """The contiguity error of the one check, on every path (it used to come from whichever pass ran first)."""
    policy, _ = models
    tokens = torch.zeros(2, 4, dtype=torch.long)
    holes = torch.tensor([[True, True, True, True], [True, False, False, True]])
    for options in ({}, {"share_prefix": True}, {"token_budget": 4}):
        with pytest.raises(ValueError, match=r"attention_mask: expected each row .* rows \[1\] have holes"):
            score_tokens(policy, tokens, holes, **options)
