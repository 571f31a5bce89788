"""The scoring engine's ``where`` / ``keep_hidden`` / ``kl_to``: the head only at scored positions,
the reference's hidden states kept there, and the exact KL computed from them in the policy's pass."""

from __future__ import annotations

import importlib
from unittest import mock

import pytest
import torch

from tests.helpers import make_tiny_model, make_tokenizer
from tests.models.test_exact_kl_tokens import naive_kl
from tests.models.test_shared_prefix import grpo_batch, model64  # noqa: F401 (fixture)
from tether.models import score_plan
from tether.models.scoring import exact_kl_tokens, score_tokens


def _answers(tokens: torch.Tensor, mask: torch.Tensor, *, into_prompt: int = 0) -> torch.Tensor:
    """The response columns of ``grpo_batch`` (prompt width 6), optionally ``into_prompt``
    columns more to the left so that some wanted positions lie inside the shared prefix."""
    where = mask.clone()
    where[:, : 6 - into_prompt] = False
    return where


@pytest.mark.parametrize("share_prefix", [False, True])
@pytest.mark.parametrize("into_prompt", [0, 2])
def test_where_gives_the_full_scores_at_its_positions_and_zero_elsewhere(model64, share_prefix, into_prompt):
    """Float64: log-probs and entropies at ``where`` equal plain scoring's to 1e-12, whether the
    wanted positions are all in the answers or some are inside the shared prompt prefix."""
    tokens, mask = grpo_batch([3, 6, 5], group=3, max_response=4)
    where = _answers(tokens, mask, into_prompt=into_prompt)
    full = score_tokens(model64, tokens, mask, with_entropy=True, share_prefix=share_prefix)
    part = score_tokens(model64, tokens, mask, with_entropy=True, share_prefix=share_prefix, where=where)
    torch.testing.assert_close(part.log_probs, full.log_probs * where, rtol=0, atol=1e-12)
    torch.testing.assert_close(part.entropy, full.entropy * where, rtol=0, atol=1e-12)


@pytest.mark.parametrize("share_prefix", [False, True])
def test_the_head_runs_only_at_the_wanted_positions(model64, share_prefix):
    """Every hidden state that reaches the head's log-softmax is a wanted position: the head
    sees exactly ``where.sum()`` rows (plain scoring sees every valid position but the first)."""
    tokens, mask = grpo_batch([3, 6, 5], group=3, max_response=4)
    where = _answers(tokens, mask)
    seen = []
    real = score_plan.token_stats_from_hidden

    def counting(hidden, *args, **kwargs):
        seen.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
        return real(hidden, *args, **kwargs)

    with mock.patch.object(score_plan, "token_stats_from_hidden", counting):
        score_tokens(model64, tokens, mask, share_prefix=share_prefix, where=where)
    assert sum(seen) == int(where.sum())


def test_gradients_through_where_equal_the_masked_full_loss(model64):
    """d/dtheta sum(w * log p) is the same whether the head ran everywhere or only at ``w``."""
    tokens, mask = grpo_batch([3, 6, 5], group=3, max_response=4)
    where = _answers(tokens, mask)
    weights = torch.linspace(-1, 1, where.numel(), dtype=torch.float64).reshape(where.shape)
    grads = []
    for kw in ({}, {"where": where}):
        model64.zero_grad()
        (score_tokens(model64, tokens, mask, share_prefix=True, **kw).log_probs * weights * where).sum().backward()
        grads.append([p.grad.clone() for p in model64.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.fixture(scope="module")
def two_models():
    tok = make_tokenizer()
    return make_tiny_model(tok, dtype=torch.float64, seed=0), make_tiny_model(tok, dtype=torch.float64, seed=1)


@pytest.mark.parametrize("share_prefix", [False, True])
def test_exact_kl_from_the_references_kept_hidden_states_is_the_naive_kl(two_models, share_prefix):
    """The reference's pass keeps its hidden states at the answers; the policy's pass (here
    also producing the log-probs a loss would use) returns ``sum_v p log p/q`` there, equal to
    the float64 full-logits KL of each row scored alone, and 0 elsewhere."""
    policy, reference = two_models
    tokens, mask = grpo_batch([3, 6, 5], group=3, max_response=4, seed=3)
    where = _answers(tokens, mask)
    ref = score_tokens(reference, tokens, mask, where=where, keep_hidden=True, share_prefix=share_prefix)
    assert ref.hidden.hidden.shape == (int(where.sum()), 32) and not ref.hidden.hidden.requires_grad
    out = score_tokens(policy, tokens, mask, where=where, kl_to=ref.hidden, share_prefix=share_prefix)
    assert not out.exact_kl.requires_grad and out.log_probs.requires_grad
    for row in range(tokens.shape[0]):
        want = naive_kl(policy, reference, tokens[row][mask[row]], 1.0) * where[row][mask[row]]
        torch.testing.assert_close(out.exact_kl[row][mask[row]].double(), want.detach(), rtol=0, atol=1e-10)
    assert bool((out.exact_kl[~where] == 0).all())
    torch.testing.assert_close(out.exact_kl, exact_kl_tokens(policy, reference, tokens, mask, where=where),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("share_prefix", [False, True])
def test_a_kl_only_pass_gives_the_same_kl_without_the_log_probs_head(two_models, share_prefix):
    """``log_probs=False`` (the KL budget's readings): the exact KL equals the full pass's bit for
    bit, no log-probs come back, and the log-prob head never runs (it is a third of the head's
    matrix products: the policy's logits once for the log-probs, both sides once for the KL)."""
    policy, reference = two_models
    tokens, mask = grpo_batch([3, 6, 5], group=3, max_response=4, seed=6)
    where = _answers(tokens, mask)
    kept = score_tokens(reference, tokens, mask, where=where, keep_hidden=True, share_prefix=share_prefix).hidden
    full = score_tokens(policy, tokens, mask, where=where, kl_to=kept, share_prefix=share_prefix)
    calls = []
    real = score_plan.token_stats_from_hidden

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    with mock.patch.object(score_plan, "token_stats_from_hidden", counting), torch.no_grad():
        only = score_tokens(policy, tokens, mask, where=where, kl_to=kept, share_prefix=share_prefix, log_probs=False)
    assert calls == [] and only.log_probs is None
    assert torch.equal(only.exact_kl, full.exact_kl)


def test_a_pass_without_log_probs_must_ask_for_the_kl(two_models):
    policy, reference = two_models
    tokens, mask = grpo_batch([3, 6], group=2, max_response=3, seed=5)
    where = _answers(tokens, mask)
    kept = score_tokens(reference, tokens, mask, where=where, keep_hidden=True).hidden
    for kwargs in ({}, {"kl_to": kept, "with_entropy": True}):
        with pytest.raises(ValueError, match="log_probs=False: a scoring call without log-probs computes only the exact KL"):
            score_tokens(policy, tokens, mask, where=where, log_probs=False, **kwargs)


def test_kept_hidden_states_cut_by_rows_serve_micro_batches(two_models):
    """``HeadHidden.rows`` hands each micro-batch its own rows: scoring rows 0:4 and 4:9 apart
    against their slices gives the exact KL of the whole batch."""
    policy, reference = two_models
    tokens, mask = grpo_batch([3, 6, 5], group=3, max_response=4, seed=4)
    where = _answers(tokens, mask)
    kept = score_tokens(reference, tokens, mask, where=where, keep_hidden=True).hidden
    whole = score_tokens(policy, tokens, mask, where=where, kl_to=kept).exact_kl
    parts = [score_tokens(policy, tokens[b:e], mask[b:e], where=where[b:e], kl_to=kept.rows(where, b, e)).exact_kl
             for b, e in ((0, 4), (4, 9))]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-12)


def test_keep_hidden_and_kl_to_refuse_positions_they_cannot_count(two_models):
    policy, reference = two_models
    tokens, mask = grpo_batch([3, 6], group=2, max_response=3, seed=5)
    where = _answers(tokens, mask)
    with pytest.raises(ValueError, match="where: keep_hidden and kl_to need the positions"):
        score_tokens(reference, tokens, mask, keep_hidden=True)
    kept = score_tokens(reference, tokens, mask, where=where, keep_hidden=True).hidden
    fewer = where.clone()
    fewer[0] = False
    with pytest.raises(ValueError, match=r"kl_to: holds hidden states of \d+ positions but where marks \d+"):
        score_tokens(policy, tokens, mask, where=fewer, kl_to=kept)
    first = where.clone()
    first[0, mask[0].int().argmax()] = True  # a row's first token has no prediction
    with pytest.raises(ValueError, match="where: marks .* positions but .* of them are scored"):
        score_tokens(reference, tokens, mask, where=first, keep_hidden=True)
    with pytest.raises(ValueError, match=r"where: expected a bool mask of the tokens' shape"):
        score_tokens(reference, tokens, mask, where=where.long())


def test_default_head_chunk_keeps_the_cpu_scratch_under_24_mib():
    """24 MiB / (49152 x 4 B) = 128 float32 rows for the embedded model's vocabulary, 64 in float64
    (8 B; bfloat16 is reduced in float32, so 128 too); a 10^6 vocabulary in float64 would allow 3,
    raised to the floor of 16; off the CPU the ops' default stays (None)."""
    from tether.models.score_plan import default_chunk_size

    assert default_chunk_size(torch.empty(49152, 1)) == 128
    assert default_chunk_size(torch.empty(49152, 1, dtype=torch.float64)) == 64
    assert default_chunk_size(torch.empty(49152, 1, dtype=torch.bfloat16)) == 128
    assert default_chunk_size(torch.empty(10**6, 1, dtype=torch.float64)) == 16
    assert default_chunk_size(torch.empty(49152, 1, device="meta")) is None


def test_the_ops_check_one_chunk_per_scoring_call(model64):
    """A scoring call cut into several passes (token budget 12) checks the head, options and
    labels on its first chunk only: one host read of the label range and the dead positions
    (``check_scored``) and one check of the two heads (``_check_hidden_pair``) per call however
    many chunks, with log-probs, entropies and exact KL equal to 1e-12 to a call whose every
    chunk is checked."""
    exact_kl_module, logprobs = (importlib.import_module(f"tether.ops.{name}") for name in ("exact_kl", "logprobs"))
    tokens, mask = grpo_batch([3, 6, 5], group=3, max_response=4)
    where = _answers(tokens, mask)
    ref = score_tokens(model64, tokens, mask, where=where, keep_hidden=True, token_budget=12, share_prefix=False)
    calls = {"chunks": 0, "check_scored": 0, "_check_hidden_pair": 0}
    real_stats = score_plan.token_stats_from_hidden

    def counted(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return mock.patch.object(module, name, wrapper)

    def chunk(*args, **kwargs):
        calls["chunks"] += 1
        return real_stats(*args, **kwargs)

    def run():
        return score_tokens(model64, tokens, mask, where=where, with_entropy=True, kl_to=ref.hidden, token_budget=12,
                            share_prefix=False)

    with mock.patch.object(score_plan, "token_stats_from_hidden", chunk), counted(logprobs, "check_scored"), \
            counted(exact_kl_module, "_check_hidden_pair"):
        once = run()
    assert calls == {"chunks": calls["chunks"], "check_scored": 1, "_check_hidden_pair": 1} and calls["chunks"] >= 3
    with mock.patch.object(score_plan, "token_stats_from_hidden", lambda *a, **k: real_stats(*a, **{**k, "checked": True})):
        every = run()
    for name in ("log_probs", "entropy", "exact_kl"):
        torch.testing.assert_close(getattr(once, name), getattr(every, name), rtol=0, atol=1e-12)
