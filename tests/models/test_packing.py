"""Packed scoring (``tether.models.packing``): the layout and the pass plan by hand, which kernel a
model gets, and packed ``score_tokens`` (values and gradients, grouped-query attention, left
padding, rows too short to score) against a plain forward of each row on its own."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tether._compat import attention_implementation, enable_gradient_checkpointing
from tether.models.packing import ROW_ATTENTION, pack_rows, packed_kernel, row_attention
from tether.models.score_plan import Spans
from tether.models.score_plan import plan_micro_batches
from tether.models.scoring import score_tokens
from tether.models.tiny import byte_tokenizer, tiny_causal_lm


def test_pack_rows_by_hand():
    """Row 0 is left-padded ``[_, 5, 6, 7]``, row 1 right-padded ``[8, 9, _, _]``: packed ids
    5 6 7 8 9 with positions 0 1 2 0 1; each token's label is the next one of its row (6, 7, -,
    9, -), scored at 3 positions whose labels sit at flat ``row * 4 + col`` = 2, 3, 5; rows
    start at 0 and 3 of 5 tokens, the longest has 3."""
    tokens = torch.tensor([[0, 5, 6, 7], [8, 9, 0, 0]])
    mask = torch.tensor([[False, True, True, True], [True, True, False, False]])
    packed = pack_rows(tokens, Spans.of(mask))
    assert packed.ids.tolist() == [[5, 6, 7, 8, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert packed.scored.tolist() == [[True, True, False, True, False]]
    assert packed.labels[packed.scored].tolist() == [6, 7, 9]
    assert packed.flat_index.tolist() == [2, 3, 5]
    assert packed.bounds.tolist() == [0, 3, 5] and packed.longest == 3


def test_pack_rows_of_a_subset_address_the_whole_grid():
    """Packing rows ``[1, 0]`` only: row 1's ``8 9`` come first; its label 9 sits at flat 1 * 4 + 1 = 5,
    row 0's labels 6, 7 at 2, 3, exactly where the whole batch's packing puts them."""
    tokens = torch.tensor([[0, 5, 6, 7], [8, 9, 0, 0], [1, 2, 3, 4]])
    mask = tokens != 0
    packed = pack_rows(tokens, Spans.of(mask), torch.tensor([1, 0]))
    assert packed.ids.tolist() == [[8, 9, 5, 6, 7]]
    assert packed.flat_index.tolist() == [5, 2, 3]
    assert packed.bounds.tolist() == [0, 2, 5]


def test_packed_passes_by_hand():
    """Lengths 5, 9, 3, 7 with a budget of 12, longest first: 9 (9 + 7 > 12), then 7 + 5 = 12,
    then 3. A budget of 4 gives every row longer than it a pass of its own."""
    lengths = torch.tensor([5, 9, 3, 7])
    assert [p.tolist() for p in plan_micro_batches(lengths, 12, packed=True)] == [[1], [3, 0], [2]]
    assert [p.tolist() for p in plan_micro_batches(lengths, 4, packed=True)] == [[1], [3], [0], [2]]


def test_which_kernel_a_packed_pass_runs():
    """SDPA and eager models get tether's row attention; a sliding window or a model outside the
    attention interface gets none; flash-attention keeps its own kernel where it is installed."""
    model = tiny_causal_lm(byte_tokenizer())
    for impl in ("sdpa", "eager"):
        model.config._attn_implementation = impl
        assert packed_kernel(model) == ROW_ATTENTION
    model.config.sliding_window = 4
    assert packed_kernel(model) is None
    model.config.sliding_window = None
    model._supports_attention_backend = False
    assert packed_kernel(model) is None
    model._supports_attention_backend = True
    model.config._attn_implementation = "flash_attention_2"
    has_flash = importlib.util.find_spec("flash_attn") is not None
    assert packed_kernel(model) == ("flash_attention_2" if has_flash else None)


def _batch():
    """Rows of 12, 7 (left-padded), 1, 10 and 0 tokens: the 1- and 0-token rows predict nothing."""
    torch.manual_seed(0)
    tokens = torch.randint(3, 250, (5, 12))
    mask = torch.arange(12)[None, :] < torch.tensor([[12], [7], [1], [10], [0]])
    mask[1] = mask[1].flip(0)
    return tokens, mask


def _row_by_row(model, tokens, mask, temperature):
    """Each row alone through the model's own forward: no padding, no packing. ``[B, T]`` log-probs
    and entropies, 0 where nothing is predicted."""
    log_probs = torch.zeros(tokens.shape, dtype=torch.float64)
    entropy = torch.zeros(tokens.shape, dtype=torch.float64)
    for r in range(tokens.shape[0]):
        cols = mask[r].nonzero().flatten()
        if cols.numel() < 2:
            continue
        logits = model(input_ids=tokens[r, cols][None]).logits[0, :-1] / temperature
        logp = torch.log_softmax(logits, -1)
        log_probs[r, cols[1:]] = logp.gather(-1, tokens[r, cols[1:], None])[:, 0]
        entropy[r, cols[1:]] = -(logp.exp() * logp).sum(-1)
    return log_probs, entropy


def test_packed_scores_equal_each_row_alone_values_and_gradients():
    """float64, a grouped-query model (4 heads, 2 KV heads), a budget of 20 tokens (two passes:
    12, then 10 + 7 + 1 + 0): log-probs and entropies equal each row's own forward to 1e-12, and the gradient
    of their sum to every weight to 1e-10. The attention kernel is the model's again afterwards."""
    model = tiny_causal_lm(byte_tokenizer(), dtype=torch.float64)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    tokens, mask = _batch()
    packed = score_tokens(model, tokens, mask, with_entropy=True, temperature=0.7, token_budget=20)
    assert attention_implementation(model) == "sdpa"
    (packed.log_probs.sum() + packed.entropy.sum()).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    log_probs, entropy = _row_by_row(model, tokens, mask, 0.7)
    (log_probs.sum() + entropy.sum()).backward()
    torch.testing.assert_close(packed.log_probs, log_probs, rtol=0, atol=1e-12)
    torch.testing.assert_close(packed.entropy, entropy, rtol=0, atol=1e-12)
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=0, atol=1e-10, msg=name)


def test_gradient_checkpointing_keeps_padded_passes():
    """Checkpointed layers re-run their forward in backward, after a packed pass has switched the
    kernel back: there packing would attend across rows. With checkpointing on, the gradient still
    equals each row's own (to 1e-10) because those passes stay right-padded."""
    model = tiny_causal_lm(byte_tokenizer(), dtype=torch.float64)
    enable_gradient_checkpointing(model)
    model.train()
    tokens, mask = _batch()
    score_tokens(model, tokens, mask, token_budget=20).log_probs.sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _row_by_row(model, tokens, mask, 1.0)[0].sum().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=0, atol=1e-10, msg=name)


def test_row_attention_refuses_calls_without_row_boundaries():
    """Registered for packed passes only: a padded batch, or a sliding window, is an error, not a guess."""
    model = tiny_causal_lm(byte_tokenizer())
    q = torch.zeros(2, 4, 3, 8)
    with pytest.raises(RuntimeError, match="cu_seq_lens_q"):
        row_attention(model, q, q, q, None)
    one = torch.zeros(1, 4, 3, 8)
    bounds = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="sliding_window=2"):
        row_attention(model, one, one, one, None, cu_seq_lens_q=bounds, max_length_q=3, sliding_window=2)


def test_the_kernel_is_restored_when_a_pass_fails(monkeypatch):
    """An error inside a packed pass leaves the model on its own kernel."""
    model = tiny_causal_lm(byte_tokenizer())
    tokens, mask = _batch()

    attention = model.model.layers[0].self_attn
    forward = attention.forward

    def fail_when_packed(*args, **kwargs):  # the model's own probe passes run as usual
        if attention_implementation(model) == ROW_ATTENTION:
            raise ValueError("boom")
        return forward(*args, **kwargs)

    monkeypatch.setattr(attention, "forward", fail_when_packed)
    with torch.no_grad(), pytest.raises(ValueError, match="boom"):
        score_tokens(model, tokens, mask)
    assert attention_implementation(model) == "sdpa"
    assert packed_kernel(model) == ROW_ATTENTION


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
                    reason="needs a CUDA GPU with flash-attn installed")
def test_packed_batch_equals_padded_micro_batches_on_cuda():
    tok = byte_tokenizer()
    model = tiny_causal_lm(tok, dtype=torch.bfloat16).cuda()
    tokens = torch.randint(0, 250, (4, 12), device="cuda")
    mask = torch.arange(12, device="cuda")[None, :] < torch.tensor([[12], [7], [3], [10]], device="cuda")
    with torch.no_grad():
        plain = score_tokens(model, tokens, mask)
        model.config._attn_implementation = "flash_attention_2"
        assert packed_kernel(model) == "flash_attention_2"
        packed = score_tokens(model, tokens, mask)
    assert packed.log_probs.dtype == torch.float32
    torch.testing.assert_close(packed.log_probs, plain.log_probs, rtol=0, atol=5e-2)
