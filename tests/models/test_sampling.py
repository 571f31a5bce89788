"""The decode loop: recorded log-probs, eos handling, determinism, and the sampled law."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tether.models.sampling import sample_responses
from tether.ops.logprobs import draw_categorical, invert_cdf
from tests.helpers import make_tiny_model, make_tokenizer


def prompts(tok, texts):
    rows = [torch.tensor(tok(t)["input_ids"]) for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = True
    return ids, mask, rows


def test_recorded_logprobs_equal_rescoring():
    """Each recorded log-prob equals log_softmax(logits / T) of the full sequence re-run."""
    tok = make_tokenizer()
    model = make_tiny_model(tok, dtype=torch.float64)
    ids, mask, rows = prompts(tok, ["hello", "a", "what is 2+2?"])
    g = torch.Generator().manual_seed(3)
    out = sample_responses(model, ids, mask, max_new_tokens=12, eos_ids={tok.eos_token_id},
                           pad_id=tok.pad_token_id, temperature=0.7, generator=g)
    for i, prompt in enumerate(rows):
        resp = out.tokens[i][out.mask[i]]
        full = torch.cat([prompt, resp])
        logits = model(input_ids=full[None]).logits[0, len(prompt) - 1 : -1].double() / 0.7
        expected = F.log_softmax(logits, -1).gather(-1, resp[:, None]).squeeze(-1)
        torch.testing.assert_close(out.log_probs[i][out.mask[i]].double(), expected, rtol=0, atol=1e-5)
    assert torch.all(out.log_probs[~out.mask] == 0)


def eos_biased_model(tok, p_eos=0.15):
    """Tiny model whose head is near-uniform except eos, which gets probability ~p_eos.

    Logits are shrunk to ~0 and eos gets bias log(p (V-1) / (1-p)), so that
    P(eos) = e^b / (e^b + V - 1) = p_eos at every step.
    """
    import math

    model = make_tiny_model(tok)
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight * 1e-4)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = math.log(p_eos * (old.out_features - 1) / (1 - p_eos))
    model.lm_head = head
    return model


def test_eos_ends_rows_and_is_kept():
    """With pad == eos, a row stops at its first eos, which stays in the mask with its log-prob."""
    tok = make_tokenizer(pad_is_eos=True)
    model = eos_biased_model(tok)
    eos = tok.eos_token_id
    ids, mask, _ = prompts(tok, ["x", "yy", "zzz", "w", "v", "u"])
    out = sample_responses(model, ids, mask, max_new_tokens=30, eos_ids={eos}, pad_id=eos,
                           generator=torch.Generator().manual_seed(0))
    lengths = out.mask.sum(-1)
    assert lengths.unique().numel() > 1  # rows really ended at different steps
    for i in range(6):
        n = int(lengths[i])
        row = out.tokens[i, :n]
        assert bool(out.finished[i]) and row[-1] == eos and not (row[:-1] == eos).any()
        # log(0.15) within float error: the eos log-prob is recorded, not dropped as padding.
        assert abs(float(out.log_probs[i, n - 1]) - torch.log(torch.tensor(0.15)).item()) < 1e-3
    assert torch.all(out.tokens[~out.mask] == eos) and torch.all(out.log_probs[~out.mask] == 0)


def test_max_new_tokens_truncates_and_flags():
    tok = make_tokenizer()
    model = make_tiny_model(tok)
    ids, mask, _ = prompts(tok, ["abc", "de"])
    out = sample_responses(model, ids, mask, max_new_tokens=3, eos_ids={tok.eos_token_id},
                           pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(1))
    assert out.tokens.shape[1] <= 3
    for i in range(2):
        n = int(out.mask[i].sum())
        assert bool(out.finished[i]) == (out.tokens[i, n - 1] == tok.eos_token_id).item()


def test_seeded_generator_is_reproducible():
    tok = make_tokenizer()
    model = make_tiny_model(tok)
    ids, mask, _ = prompts(tok, ["one", "two", "three"])
    kw = dict(max_new_tokens=10, eos_ids={tok.eos_token_id}, pad_id=tok.pad_token_id)
    a = sample_responses(model, ids, mask, generator=torch.Generator().manual_seed(5), **kw)
    b = sample_responses(model, ids, mask, generator=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.log_probs, b.log_probs)


def test_greedy_matches_hf_generate():
    tok = make_tokenizer()
    model = make_tiny_model(tok)
    ids, mask, _ = prompts(tok, ["hi there", "q"])
    out = sample_responses(model, ids, mask, max_new_tokens=8, eos_ids={tok.eos_token_id},
                           pad_id=tok.pad_token_id, do_sample=False)
    ref = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=8, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    for i in range(2):
        n = int(out.mask[i].sum())
        assert torch.equal(out.tokens[i, :n], ref[i, :n])


def test_first_token_law_matches_softmax():
    """Empirical first-token frequencies over 20k draws match softmax(logits / T).

    With 20k seeded draws the total-variation distance between the empirical and the exact
    law is about sqrt(V / N) / 2 ~ 0.06 at most for V = 260; we require < 0.05 after
    restricting to tokens of probability > 1e-3 (the rest carries < 0.3 mass).
    """
    tok = make_tokenizer()
    model = make_tiny_model(tok, dtype=torch.float64)
    row = torch.tensor(tok("ab")["input_ids"])
    n = 20000
    ids = row.repeat(n, 1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    out = sample_responses(model, ids, mask, max_new_tokens=1, eos_ids={tok.eos_token_id},
                           pad_id=tok.pad_token_id, temperature=1.5, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(model(input_ids=row[None]).logits[0, -1].double() / 1.5, -1)
    freq = torch.bincount(out.tokens[:, 0], minlength=probs.numel()).double() / n
    keep = probs > 1e-3
    tv = 0.5 * (freq[keep] - probs[keep]).abs().sum()
    assert tv < 0.05
    # The recorded log-prob of each draw is the exact log-probability of that token.
    torch.testing.assert_close(out.log_probs[:, 0].double(), probs.log()[out.tokens[:, 0]], rtol=0, atol=1e-5)


def test_top_k_restricts_support():
    tok = make_tokenizer()
    model = make_tiny_model(tok)
    row = torch.tensor(tok("ab")["input_ids"])
    ids = row.repeat(500, 1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    out = sample_responses(model, ids, mask, max_new_tokens=1, eos_ids={tok.eos_token_id},
                           pad_id=tok.pad_token_id, top_k=3, generator=torch.Generator().manual_seed(0))
    top3 = torch.topk(model(input_ids=row[None]).logits[0, -1], 3).indices
    assert set(out.tokens[:, 0].tolist()) <= set(top3.tolist())


def test_repeated_prompts_are_prefilled_once_with_the_same_results(monkeypatch):
    """A GRPO-shaped batch (each prompt 3 times) prefills 2 rows, not 6; decoding then runs
    on all 6, greedy rows of one prompt agree, and sampled log-probs still equal rescoring."""
    tok = make_tokenizer()
    model = make_tiny_model(tok, dtype=torch.float64)
    ids, mask, rows = prompts(tok, ["hello", "what is 2+2?"])
    ids, mask = ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)
    rows = [r for r in rows for _ in range(3)]
    batch_sizes = []
    forward = model.forward

    def counting_forward(*args, **kwargs):
        batch_sizes.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counting_forward)
    greedy = sample_responses(model, ids, mask, max_new_tokens=6, eos_ids={tok.eos_token_id},
                              pad_id=tok.pad_token_id, do_sample=False)
    assert batch_sizes[0] == 2 and batch_sizes[1] == 6
    for group in (slice(0, 3), slice(3, 6)):
        assert (greedy.tokens[group] == greedy.tokens[group][0]).all()
    sampled = sample_responses(model, ids, mask, max_new_tokens=8, eos_ids={tok.eos_token_id},
                               pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(5))
    for i, prompt in enumerate(rows):
        resp = sampled.tokens[i][sampled.mask[i]]
        logits = forward(input_ids=torch.cat([prompt, resp])[None]).logits[0, len(prompt) - 1 : -1]
        expected = F.log_softmax(logits.double(), -1).gather(-1, resp[:, None]).squeeze(-1)
        torch.testing.assert_close(sampled.log_probs[i][sampled.mask[i]].double(), expected, rtol=0, atol=1e-5)


def _left_padded(rows, pad_id):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = True
    return ids, mask


def test_continuing_from_kept_caches_equals_sampling_the_whole_rows():
    """A first call keeps each row's cache; each row then grows by its sampled tokens and a few
    more (a tool turn's worth, of different lengths). Sampling the grown rows from scratch and
    sampling only their new tokens after the kept caches draw the same tokens from the same seed,
    with the same log-probs (float64 model; HF's RMSNorm rounds in float32, hence 1e-6)."""
    tok = make_tokenizer()
    model = eos_biased_model(tok, p_eos=0.3).double()
    ids, mask, rows = prompts(tok, ["hello", "a", "what is 2+2?", "zz"])
    first = sample_responses(model, ids, mask, max_new_tokens=6, eos_ids={tok.eos_token_id},
                             pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0), keep_cache=True)
    grown, new = [], []
    for i, prompt in enumerate(rows):
        sampled = first.tokens[i][first.mask[i]].tolist()
        grown.append(prompt.tolist() + sampled + tok(" x" * (i + 1))["input_ids"])
        cache = first.caches[i]
        assert cache.length == len(prompt) + len(sampled) - 1  # all but the last sampled token
        new.append(grown[-1][cache.length:])
    options = dict(max_new_tokens=8, eos_ids={tok.eos_token_id}, pad_id=tok.pad_token_id, temperature=0.9)
    whole = sample_responses(model, *_left_padded(grown, tok.pad_token_id),
                             generator=torch.Generator().manual_seed(1), **options)
    after = sample_responses(model, *_left_padded(new, tok.pad_token_id), past=first.caches,
                             generator=torch.Generator().manual_seed(1), **options)
    assert torch.equal(whole.tokens, after.tokens) and torch.equal(whole.finished, after.finished)
    torch.testing.assert_close(after.log_probs, whole.log_probs, rtol=0, atol=1e-6)


def test_past_must_match_the_rows():
    import pytest

    tok = make_tokenizer()
    ids, mask, _ = prompts(tok, ["a", "b"])
    with pytest.raises(ValueError, match=r"past: expected one RowCache or None per row \(2\), got 1"):
        sample_responses(make_tiny_model(tok), ids, mask, max_new_tokens=2, eos_ids={tok.eos_token_id},
                         pad_id=tok.pad_token_id, past=[None])


def _naive_inversion(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index whose float64 cumulative mass exceeds ``u * total``, one row at a time."""
    out = []
    for row, point in zip(probs.double(), u.double()):
        cdf = row.cumsum(0)
        out.append(int((cdf > point * cdf[-1]).nonzero()[0]))
    return torch.tensor(out)


@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152])
def test_invert_cdf_equals_the_naive_inversion_and_never_picks_a_zero(vocab):
    """Random rows with a third of their entries 0 (and whole zero blocks when the vocabulary
    spans several): at 500 random points the two-level inversion picks what a plain float64
    cumulative sum picks; at u = 0 it picks each row's first entry with mass and at the largest
    float64 below 1 its last one (rounding must not land on a zero past it)."""
    gen = torch.Generator().manual_seed(vocab)
    rows = 4
    probs = torch.rand(rows, vocab, generator=gen)
    probs[torch.rand(rows, vocab, generator=gen) < 1 / 3] = 0.0
    if vocab > 512:
        probs[:, 256:512] = 0.0  # a block without mass
    probs[:, -3:] = 0.0  # rows end in zeros
    probs[0, :-3] = 0.0
    probs[0, vocab // 2] = 1.0  # a row with one entry
    u = torch.rand(500, rows, dtype=torch.float64, generator=gen)
    for point in u:
        assert torch.equal(invert_cdf(probs, point), _naive_inversion(probs, point))
    nonzero = [row.nonzero().squeeze(-1) for row in probs]
    first = torch.tensor([int(n[0]) for n in nonzero])
    last = torch.tensor([int(n[-1]) for n in nonzero])
    assert torch.equal(invert_cdf(probs, torch.zeros(rows, dtype=torch.float64)), first)
    assert torch.equal(invert_cdf(probs, torch.full((rows,), 1 - 2.0**-53, dtype=torch.float64)), last)


def test_invert_cdf_holds_rounding_at_a_rows_end_back_to_its_last_entry_with_mass():
    """At the largest float64 below 1, a row's point can round past the in-block cumulative sum
    (block masses and in-block sums are added in other orders): on 64 rows of uneven masses
    ending in zeros (about a quarter of them round so here) the pick is still each row's last
    entry with mass, never a zero after it."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(64, 768, generator=gen) ** 8
    probs[:, -6], probs[:, -5:] = 0.5, 0.0  # the last entry with mass holds far more than 2^-53 of the row
    picks = invert_cdf(probs, torch.full((64,), 1 - 2.0**-53, dtype=torch.float64))
    assert torch.equal(picks, torch.full((64,), 768 - 6))


def test_invert_cdf_on_a_grid_of_points_gives_the_exact_law():
    """N evenly spaced points (i + 0.5) / N pick entry j exactly round(p_j N) times, give or take
    one at each of its two ends: the inversion spends mass p_j on entry j, with no bias, for a
    row of small and large probabilities across several blocks."""
    vocab, n = 700, 100_000
    probs = torch.zeros(1, vocab)
    probs[0, [0, 5, 255, 256, 300, 511, 699]] = torch.tensor([0.25, 0.125, 0.0625, 0.3, 0.01, 0.2, 0.0525])
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    picks = invert_cdf(probs.expand(n, vocab), u)
    counts = torch.bincount(picks, minlength=vocab).double()
    assert torch.all((counts - probs[0].double() * n).abs() <= 1)


def test_draw_categorical_inverts_one_uniform_per_row():
    """The draw is ``invert_cdf`` at ``torch.rand(b, float64)`` from the same generator: a seed
    gives the same tokens on every rank that draws the gathered batch (``SharedDraw``)."""
    probs = torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(0)), -1)
    drawn = draw_categorical(probs, torch.Generator().manual_seed(3))
    u = torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(drawn, invert_cdf(probs, u))
