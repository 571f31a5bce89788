"""Shared-prefix scoring: the split plan, value parity, exact gradients, fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tether.models import TransformersWrapper
from tether.models.scoring import ACCELERATOR_TOKEN_BUDGET, DEFAULT_TOKEN_BUDGET, default_layout, score_tokens
from tether.models.packing import plan_prefix_split
from tether.models.score_plan import Spans, left_aligned
from tether.ops.masks import pad_rows, repack
from tests.helpers import make_tiny_model, make_tokenizer


def _attention_float64(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Textbook attention kept in the input dtype (HF's eager attention takes its softmax in
    float32, which would hide float64-level gradient parity)."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(-1, -2) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if attention_mask is None:  # HF passes None when plain causal masking suffices
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    scores = scores.masked_fill(~attention_mask[..., :kv_len], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return (weights @ value).transpose(1, 2).contiguous(), weights


AttentionInterface.register("tether_test_float64", _attention_float64)
AttentionMaskInterface.register("tether_test_float64", sdpa_mask)


def _rms_norm_float64(self, hidden):
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture
def model64(monkeypatch):
    """A float64 tiny Llama whose every op stays in float64.

    HF's Llama RMSNorm computes in float32 whatever the model dtype; two mathematically equal
    gradient paths then differ at float32 rounding (~1e-7 relative). The test model swaps in
    a float64 norm and attention so that parity can be asserted at 1e-11.
    """
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_float64)
    model = make_tiny_model(make_tokenizer(), dtype=torch.float64)
    model.config._attn_implementation = "tether_test_float64"
    return model


def grpo_batch(prompt_lengths, group, max_response, *, seed=0, vocab=250, empty_first=False):
    """Left-padded prompts (each repeated ``group`` times) followed by right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    width_p = max(prompt_lengths)
    rows, masks = [], []
    for n in prompt_lengths:
        prompt = torch.randint(3, vocab, (n,), generator=g)
        for j in range(group):
            r = 0 if (empty_first and j == 0) else int(torch.randint(1, max_response + 1, (1,), generator=g))
            row = torch.zeros(width_p + max_response, dtype=torch.long)
            mask = torch.zeros_like(row, dtype=torch.bool)
            row[width_p - n : width_p] = prompt
            row[width_p : width_p + r] = torch.randint(3, vocab, (r,), generator=g)
            mask[width_p - n : width_p + r] = True
            rows.append(row)
            masks.append(mask)
    return torch.stack(rows), torch.stack(masks)


def naive_logprobs(model, tokens, mask):
    """Each row alone, unpadded, through full logits: the definition of the scores."""
    out = torch.zeros(tokens.shape, dtype=torch.float64)
    for i in range(tokens.shape[0]):
        row = tokens[i][mask[i]]
        lp = F.log_softmax(model(input_ids=row[None]).logits[0, :-1].double(), -1)
        cols = mask[i].nonzero().flatten()[1:]
        out[i, cols] = lp.gather(-1, row[1:, None]).squeeze(-1)
    return out


def test_plan_picks_the_prompt_boundary_and_counts_savings():
    """Two prompts of 3 and 4 tokens (width 4), three answers of 1, 2 and 2 tokens each.

    Plain scoring runs every valid token: 3*3 + 3*4 + 2*(1+2+2) = 31. Cutting at the prompt
    width P=4 runs each prompt once (3 + 4) plus every answer token (10): 17, saving 14.
    Cutting at P=5 would need an answer column that all rows have; they do not (the
    1-token answers end at column 4), so P=5 is not allowed.
    """
    tokens = torch.zeros(6, 6, dtype=torch.long)
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for i, (plen, prompt) in enumerate([(3, [0, 7, 8, 9]), (4, [5, 6, 7, 8])]):
        for j, r in enumerate([1, 2, 2]):
            row = 3 * i + j
            tokens[row, :4] = torch.tensor(prompt)
            mask[row, 4 - plen : 4 + r] = True
            tokens[row, 4 : 4 + r] = torch.tensor([10 + j, 20 + j][:r])
    split = plan_prefix_split(tokens, mask)
    assert split.width == 4
    assert split.tokens_saved == 14
    assert split.inverse.tolist() in ([0, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0])
    assert sorted(split.representatives.tolist()) == [0, 3]


def test_plan_declines_when_rows_share_nothing():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 100, (5, 8), generator=g)
    mask = torch.ones(5, 8, dtype=torch.bool)
    assert plan_prefix_split(tokens, mask) is None
    tokens[:, 0] = 7  # one shared column saves 4 of 40 tokens: under the 20 % threshold
    assert plan_prefix_split(tokens, mask) is None
    assert plan_prefix_split(tokens, mask, min_saving=0.05).width == 1


def _naive_split(tokens: torch.Tensor, mask: torch.Tensor) -> tuple[int, int, list[int], list[int]] | None:
    """Every allowed cut P tried from scratch: the distinct rows of tokens[:, :P] (padding as -1),
    in first-occurrence order; the cheapest cut (first on ties) and its grouping."""
    keyed = tokens.masked_fill(~mask, -1).tolist()
    valid = mask.tolist()
    best = None
    for cut in range(1, tokens.shape[1]):
        if not all(row[cut - 1] for row in valid):
            continue
        first: dict[tuple, int] = {}
        for b, row in enumerate(keyed):
            first.setdefault(tuple(row[:cut]), b)
        reps = sorted(first.values())
        cost = sum(sum(valid[r][:cut]) for r in reps) + sum(sum(row[cut:]) for row in valid)
        if best is None or cost < best[0]:
            group = [reps.index(first[tuple(row[:cut])]) for row in keyed]
            best = (cost, cut, reps, group)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_plan_equals_a_from_scratch_search_of_every_cut(seed):
    """The plan finds the distinct prefixes column by column (score_plan.distinct_rows on
    (prefix group, token)); a search that groups every cut's whole prefix anew picks the same
    cut, the same grouping and the same saving."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 6, (3, 5), generator=g)
    rows = torch.randint(0, 3, (9,), generator=g)
    tokens = torch.cat([prompts[rows], torch.randint(3, 5, (9, 4), generator=g)], dim=1)
    starts = torch.randint(0, 3, (3,), generator=g)[rows]
    ends = torch.randint(5 + seed % 3, 10, (9,), generator=g)  # later seeds allow longer cuts
    cols = torch.arange(9)
    mask = (cols >= starts[:, None]) & (cols < ends[:, None])
    split = plan_prefix_split(tokens, mask, min_saving=0.0)
    naive = _naive_split(tokens, mask)
    total = int(mask.sum())
    if naive is None or naive[0] == total:  # no allowed cut saves anything
        assert split is None
        return
    cost, cut, reps, group = naive
    order = split.representatives.argsort()  # the plan numbers groups by sorted prefix, not first row
    renumber = torch.empty_like(order)
    renumber[order] = torch.arange(order.numel())
    assert (split.width, split.tokens_saved) == (cut, total - cost)
    assert sorted(split.representatives.tolist()) == reps
    assert renumber[split.inverse].tolist() == group


@pytest.mark.parametrize("budget", [1, 7, 4096])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_values_match_plain_scoring(model64, budget, with_entropy):
    """Prompts of different lengths, ragged answers, an empty answer, any token budget."""
    tokens, mask = grpo_batch([3, 6, 5], group=4, max_response=5, empty_first=True)
    assert plan_prefix_split(tokens, mask) is not None
    plain = score_tokens(model64, tokens, mask, with_entropy=with_entropy, token_budget=budget)
    shared = score_tokens(model64, tokens, mask, with_entropy=with_entropy, token_budget=budget, share_prefix=True)
    torch.testing.assert_close(shared.log_probs, plain.log_probs, rtol=0, atol=1e-12)
    torch.testing.assert_close(shared.log_probs, naive_logprobs(model64, tokens, mask), rtol=0, atol=1e-12)
    if with_entropy:
        torch.testing.assert_close(shared.entropy, plain.entropy, rtol=0, atol=1e-12)


def test_gradients_match_rows_scored_alone(model64):
    """d/dtheta of sum(w * log p) equals the sum over rows scored one at a time, unpadded:
    the shared prompt receives each of its rows' contributions exactly once."""
    tokens, mask = grpo_batch([4, 2], group=3, max_response=4, seed=3)
    weights = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def grads(fn):
        model64.zero_grad()
        (fn() * weights * mask).sum().backward()
        return {n: p.grad.clone() for n, p in model64.named_parameters() if p.grad is not None}

    expected = grads(lambda: naive_logprobs(model64, tokens, mask))
    got = grads(lambda: score_tokens(model64, tokens, mask, share_prefix=True, token_budget=5).log_probs)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-11, msg=name)


def test_falls_back_to_plain_scoring_bit_for_bit(model64):
    """Nothing to share: the shared path must not change a single bit."""
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, 200, (4, 9), generator=g)
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[1, :3] = False
    plain = score_tokens(model64, tokens, mask).log_probs
    assert torch.equal(score_tokens(model64, tokens, mask, share_prefix=True).log_probs, plain)


def test_wrapper_shares_by_default_and_can_opt_out(model64):
    tokens, mask = grpo_batch([5, 3], group=3, max_response=3)
    on = TransformersWrapper(model64, input_mode="tokens", generate=False)
    off = TransformersWrapper(model64, input_mode="tokens", generate=False, share_prefix=False)
    assert on.share_prefix is None and not off.share_prefix  # None: by the device, shared on a CPU
    shared = score_tokens(model64, tokens, mask, share_prefix=True, token_budget=DEFAULT_TOKEN_BUDGET).log_probs
    assert torch.equal(on.score(tokens, mask).log_probs, shared)
    torch.testing.assert_close(on.score(tokens, mask).log_probs, off.score(tokens, mask).log_probs, rtol=0, atol=1e-12)


def test_the_default_layout_by_device():
    """A CPU scores in small forwards with shared prompts; an accelerator (launch-bound) in few
    large ones without the column-by-column prompt search."""
    assert default_layout(torch.device("cpu")) == (DEFAULT_TOKEN_BUDGET, True) == (1024, True)
    assert default_layout(torch.device("cuda", 0)) == (ACCELERATOR_TOKEN_BUDGET, False) == (32768, False)
    assert default_layout(torch.device("meta")) == (32768, False)


def test_holes_in_a_row_are_refused_as_in_plain_scoring(model64):
    tokens, mask = grpo_batch([4, 4], group=2, max_response=3)
    mask[0, 5] = False
    mask[0, 6] = True
    with pytest.raises(ValueError, match="contiguous run"):
        score_tokens(model64, tokens, mask, share_prefix=True)


def test_padding_ids_outside_the_vocabulary_are_never_looked_up(model64):
    """Padding may hold any id (here one past the vocabulary): only the mask says what is real."""
    tokens, mask = grpo_batch([4, 6], group=3, max_response=4, seed=5)
    expected = score_tokens(model64, tokens, mask, share_prefix=True).log_probs
    tokens = tokens.masked_fill(~mask, model64.config.vocab_size)
    torch.testing.assert_close(score_tokens(model64, tokens, mask, share_prefix=True).log_probs, expected, rtol=0, atol=0)


def _hand_batch(padding_side):
    """The plan test's batch (prompts [7, 8, 9] and [5, 6, 7, 8], answers of 1, 2 and 2 tokens)
    with whole rows padded on ``padding_side``."""
    rows = [[7, 8, 9, 10], [7, 8, 9, 10, 21], [7, 8, 9, 11, 22],
            [5, 6, 7, 8, 10], [5, 6, 7, 8, 11, 21], [5, 6, 7, 8, 12, 22]]
    padded = pad_rows([torch.tensor(r) for r in rows], padding_side=padding_side)
    return padded.values, padded.mask


def test_a_left_padded_batch_shares_its_prompts_as_a_right_padded_one(model64):
    """Left padding shifts each copy of a prompt by its own answer's length, so on the batch's
    grid the copies of [7, 8, 9] start at columns 2, 1, 1 and those of [5, 6, 7, 8] at 1, 0, 0.
    The best cut there, P = 4, finds 4 distinct row prefixes ([_, _, 7, 8], [_, 7, 8, 9],
    [_, 5, 6, 7], [5, 6, 7, 8]; 12 tokens) plus 12 tokens after column 4: 24 of 31, saving 7
    (P = 3: 8 + 18, saving 5; P = 5: six distinct rows). Scoring plans on the rows moved to
    column 0, where the best cut is P = 3 (the tie with P = 4 goes to the first): the two prompts
    run once (2 x 3 tokens) and the 6 suffixes of 1, 2, 2, 2, 3, 3 tokens in one right-padded pass
    of 6 x 3, so the decoder embeds 6 + 18 = 24 ids where plain scoring embeds 6 x 6 = 36 (the
    test model's float64 attention cannot be packed: one right-padded pass). Values equal plain
    scoring."""
    tokens, mask = _hand_batch("left")
    assert (plan_prefix_split(tokens, mask).width, plan_prefix_split(tokens, mask).tokens_saved) == (4, 7)
    aligned, aligned_mask, _ = left_aligned(tokens, Spans.of(mask))
    assert torch.equal(aligned, _hand_batch("right")[0]) and torch.equal(aligned_mask, _hand_batch("right")[1])
    split = plan_prefix_split(aligned, aligned_mask)
    assert (split.width, split.tokens_saved) == (3, 12)

    score_tokens(model64, tokens, mask)  # the model's one-off head probe runs here, not below
    embedded = []
    hook = model64.get_input_embeddings().register_forward_hook(lambda m, args, out: embedded.append(args[0].numel()))
    try:
        plain = score_tokens(model64, tokens, mask)
        plain_count = sum(embedded)
        embedded.clear()
        shared = score_tokens(model64, tokens, mask, share_prefix=True)
    finally:
        hook.remove()
    assert (plain_count, sum(embedded)) == (36, 24)
    torch.testing.assert_close(shared.log_probs, plain.log_probs, rtol=0, atol=1e-12)
    torch.testing.assert_close(shared.log_probs, naive_logprobs(model64, tokens, mask), rtol=0, atol=1e-12)


def test_kept_hidden_states_and_the_exact_kl_land_on_the_batch_grid(model64):
    """Through the left-aligned grid, ``where``, ``keep_hidden`` and ``kl_to`` still refer to the
    caller's positions: kept hidden states in the caller's row-major order and the exact KL per
    position equal plain scoring's, on a left-padded GRPO batch."""
    tokens, mask = repack(*grpo_batch([3, 6, 5], group=4, max_response=5, seed=4), "left")
    where = mask.clone()
    where[:, :-6] = False  # the answers and the last prompt tokens of the longest rows
    where &= torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)  # a prediction exists
    other = make_tiny_model(make_tokenizer(), dtype=torch.float64, seed=1)
    other.config._attn_implementation = "tether_test_float64"
    runs = {}
    for share in (False, True):
        ref = score_tokens(other, tokens, mask, where=where, keep_hidden=True, share_prefix=share)
        runs[share] = (ref, score_tokens(model64, tokens, mask, where=where, kl_to=ref.hidden, share_prefix=share))
    assert plan_prefix_split(*left_aligned(tokens, Spans.of(mask))[:2]) is not None
    (ref_plain, kl_plain), (ref_shared, kl_shared) = runs[False], runs[True]
    torch.testing.assert_close(ref_shared.hidden.hidden, ref_plain.hidden.hidden, rtol=0, atol=1e-12)
    torch.testing.assert_close(ref_shared.log_probs, ref_plain.log_probs, rtol=0, atol=1e-12)
    torch.testing.assert_close(kl_shared.exact_kl, kl_plain.exact_kl, rtol=0, atol=1e-12)
    assert float(kl_plain.exact_kl[where].min()) > 0 and not kl_plain.exact_kl[~where].any()
