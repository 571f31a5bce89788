"""Packed scoring (``tether.models.packing``): the layout by hand, the guard, and parity with
``score_tokens`` where packing cannot leak across rows (one row on CPU; any batch on a CUDA
machine with flash-attention, skipped elsewhere)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tether.models.packing import pack_rows, packing_supported, score_packed
from tether.models.score_sink import TokenSink
from tether.models.scoring import causal_lm_parts, score_tokens
from tether.models.tiny import byte_tokenizer, tiny_causal_lm


def test_pack_rows_by_hand():
    """Row 0 is left-padded ``[_, 5, 6, 7]``, row 1 right-padded ``[8, 9, _, _]``: packed ids
    5 6 7 8 9 with positions 0 1 2 0 1; each token's label is the next one of its row (6, 7, -,
    9, -), scored at 4 positions whose labels sit at flat ``row * 4 + col`` = 2, 3, 5."""
    tokens = torch.tensor([[0, 5, 6, 7], [8, 9, 0, 0]])
    mask = torch.tensor([[False, True, True, True], [True, True, False, False]])
    packed = pack_rows(tokens, mask)
    assert packed.ids.tolist() == [[5, 6, 7, 8, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert packed.scored.tolist() == [[True, True, False, True, False]]
    assert packed.labels[packed.scored].tolist() == [6, 7, 9]
    assert packed.flat_index.tolist() == [2, 3, 5]


def test_packing_is_refused_without_a_varlen_kernel():
    """SDPA and eager attention would let packed rows attend across each other."""
    model = tiny_causal_lm(byte_tokenizer())
    for impl in ("sdpa", "eager"):
        model.config._attn_implementation = impl
        assert not packing_supported(model)
    model.config._attn_implementation = "flash_attention_2"
    assert packing_supported(model) == (importlib.util.find_spec("flash_attn") is not None)


def test_one_packed_row_equals_score_tokens():
    """A single row has no boundary to leak across, so any attention gives the plain values."""
    tok = byte_tokenizer()
    model = tiny_causal_lm(tok, dtype=torch.float64)
    tokens = torch.tensor([[0, 0, 257, 72, 105, 33, 258, 10]])
    mask = tokens != 0
    parts = causal_lm_parts(model)
    with torch.no_grad():
        sink = TokenSink(parts.head, tuple(tokens.shape), where=None, temperature=0.7, chunk_size=3, with_entropy=True)
        score_packed(parts.decoder, tokens, mask, sink)
        packed = sink.result()
        plain = score_tokens(model, tokens, mask, temperature=0.7, with_entropy=True)
    torch.testing.assert_close(packed.log_probs, plain.log_probs, rtol=0, atol=1e-12)
    torch.testing.assert_close(packed.entropy, plain.entropy, rtol=0, atol=1e-12)


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
        assert packing_supported(model)
        packed = score_tokens(model, tokens, mask)
    assert packed.log_probs.dtype == torch.float32
    torch.testing.assert_close(packed.log_probs, plain.log_probs, rtol=0, atol=5e-2)
