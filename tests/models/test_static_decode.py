"""Decoding over static key/value buffers (``tether.models.static_decode``) against the dynamic loop.

The two loops draw from the same live rows with the same generator, so on a float64 model they
must give the same tokens, masks and ``finished`` flags, and log-probs equal to rounding; on a
GPU the static step is a replayed CUDA graph and must agree with its eager self and the dynamic loop.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from tests.helpers import make_tiny_model, make_tokenizer
from tests.models.test_sampling import prompts
from tether._compat import attention_kernel, register_attention
from tether.models import static_decode
from tether.models.sampling import RowCache, sample_responses
from tether.models.static_decode import STATIC_ATTENTION, GraphNote, StaticDecoder, static_decode_supported

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TEXTS = ["hello", "a", "what is 2+2?", "a", "hello", "ok then"]
DISTINCT = ["what is 2+2?", "b", "hello", "a", "zz top", "ok then"]  # not in sorted order


def ending_model(tok, p_eos: float = 0.15, dtype=torch.float64):
    """The tiny GQA Llama (4 query heads over 2 key/value heads) with an eos bias of
    ``log(p (V - 1) / (1 - p))`` added to its head, so rows end at different steps."""
    model = make_tiny_model(tok, dtype=dtype).eval()
    bias = math.log(p_eos * (model.config.vocab_size - 1) / (1 - p_eos))
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight * 0.05)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = bias
    model.lm_head = head
    return model


def both_loops(model, ids, mask, tok, seed: int | None, **options):
    """The same call through the dynamic loop and over static buffers, each with a fresh generator."""
    device = ids.device
    out = []
    for static in (False, True):
        generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
        out.append(sample_responses(model, ids, mask, eos_ids={tok.eos_token_id}, pad_id=tok.pad_token_id,
                                    generator=generator, static_cache=static, do_sample=seed is not None,
                                    **options))
    return out


@pytest.mark.parametrize("texts", [TEXTS, DISTINCT])
@pytest.mark.parametrize("seed, p_eos, options", [
    (None, 0.001, {"row_limits": torch.tensor([3, 20, 1, 8, 20, 5])}),
    (3, 0.15, {}),
    (4, 0.1, {"top_k": 7, "temperature": 1.3}),
    (5, 0.15, {"top_p": 0.9, "row_limits": torch.tensor([3, 20, 1, 8, 20, 5])}),
])
def test_static_buffers_give_the_dynamic_loops_answers(texts, seed, p_eos, options):
    """Ragged left-padded prompts, two of them repeated (prefilled once) or all distinct (read in
    their own order: the first GPU run read them in sorted order, and every answer went to another
    row), rows ending at an eos or their limit at different steps: same tokens, masks and flags;
    log-probs within 1e-12 (float64)."""
    tok = make_tokenizer()
    model = ending_model(tok, p_eos)
    ids, mask, _ = prompts(tok, texts)
    dynamic, static = both_loops(model, ids, mask, tok, seed, max_new_tokens=20, **options)
    assert torch.equal(static.tokens, dynamic.tokens) and torch.equal(static.mask, dynamic.mask)
    assert torch.equal(static.finished, dynamic.finished)
    torch.testing.assert_close(static.log_probs, dynamic.log_probs, rtol=0, atol=1e-12)
    lengths = dynamic.mask.sum(-1)
    assert lengths.unique().numel() > 1, "the case must end rows at different steps"


def test_each_distinct_prompt_is_read_once_and_every_row_is_decoded():
    """Six rows of four distinct prompts: the prefill's attention sees 4 rows, each decode step 6
    (finished rows stay in the buffers), and there are as many decode steps as the longest answer."""
    tok = make_tokenizer()
    model = ending_model(tok, p_eos=0.3)
    ids, mask, _ = prompts(tok, TEXTS)
    seen = []

    def counting(module, query, *args, **kwargs):
        if module.layer_idx == 0:
            seen.append((query.shape[0], query.shape[2]))
        return static_decode.static_attention(module, query, *args, **kwargs)

    register_attention(STATIC_ATTENTION, counting)
    try:
        out = sample_responses(model, ids, mask, max_new_tokens=12, eos_ids={tok.eos_token_id},
                               pad_id=tok.pad_token_id, generator=torch.Generator().manual_seed(1),
                               static_cache=True)
    finally:
        register_attention(STATIC_ATTENTION, static_decode.static_attention)
    longest = int(out.mask.sum(-1).max())
    assert seen[0] == (4, ids.shape[1])
    assert seen[1:] == [(6, 1)] * (longest - 1)


def test_static_cache_true_is_refused_where_it_cannot_apply():
    """Continued rows, kept caches and a sliding-window model each get a ValueError naming why."""
    tok = make_tokenizer()
    model = make_tiny_model(tok, dtype=torch.float64)
    ids, mask, _ = prompts(tok, ["hello", "a"])
    common = dict(max_new_tokens=3, eos_ids={tok.eos_token_id}, pad_id=tok.pad_token_id, static_cache=True)
    with pytest.raises(ValueError, match=r"static_cache=True.*keep_cache=True"):
        sample_responses(model, ids, mask, keep_cache=True, **common)
    cache = RowCache(tuple((torch.zeros(2, 1, 8, dtype=torch.float64),) * 2 for _ in range(2)))
    with pytest.raises(ValueError, match=r"static_cache=True.*past="):
        sample_responses(model, ids, mask, past=[cache, None], **common)
    model.config.sliding_window = 4
    assert not static_decode_supported(model)
    with pytest.raises(ValueError, match=r"static_cache=True.*sliding window"):
        sample_responses(model, ids, mask, **common)
    # Left to choose (None), the same calls take the dynamic loop: on a CPU it is the default anyway.
    out = sample_responses(model, ids, mask, **{**common, "static_cache": None})
    assert out.tokens.shape[0] == 2 and bool(out.mask[:, 0].all())


def test_the_kernel_refuses_a_forward_without_its_buffers():
    """Switched on by hand for a plain forward, the kernel says what it serves instead of
    attending over nothing."""
    tok = make_tokenizer()
    model = make_tiny_model(tok)
    with attention_kernel(model, STATIC_ATTENTION), pytest.raises(RuntimeError, match="static_kv="):
        model(input_ids=torch.tensor([[5, 6, 7]]))


@needs_cuda
@pytest.mark.parametrize("seed", [None, 11])
def test_the_graph_replay_equals_the_dynamic_loop_on_cuda(seed):
    """float32 on the GPU: the auto choice (static buffers, replayed graph) against the dynamic loop:
    same tokens and masks, log-probs within 1e-4 (the kernels differ: masked SDPA over the buffer
    against the cache's SDPA), and no GraphNote (the step was captured)."""
    tok = make_tokenizer()
    model = ending_model(tok, dtype=torch.float32).cuda()
    ids, mask, _ = prompts(tok, TEXTS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphNote)
        dynamic, static = both_loops(model, ids.cuda(), mask.cuda(), tok, seed, max_new_tokens=24)
    assert torch.equal(static.tokens, dynamic.tokens) and torch.equal(static.mask, dynamic.mask)
    torch.testing.assert_close(static.log_probs, dynamic.log_probs, rtol=0, atol=1e-4)


@needs_cuda
def test_a_captured_step_replays_the_eager_steps_on_cuda():
    """Two decoders over the same prompts, one capturing its step as a CUDA graph: five steps of
    the same tokens give the same logits (1e-5), and the graph exists."""
    tok = make_tokenizer()
    model = make_tiny_model(tok, dtype=torch.float32).cuda().eval()
    ids, mask, _ = prompts(tok, TEXTS)
    ids, mask = ids.cuda(), mask.cuda()
    first = torch.arange(ids.shape[0], device="cuda")
    runs = []
    with torch.no_grad():
        for graph in (False, True):
            decoder = StaticDecoder(model, ids.shape[0], ids.shape[1] + 8, graph=graph)
            logits = [decoder.prefill(ids, mask, first, None)[:, -1]]
            for _ in range(5):
                logits.append(decoder(logits[-1].argmax(-1)))
            runs.append((decoder, torch.stack(logits)))
    assert runs[1][0].graph is not None and runs[0][0].graph is None
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=0, atol=1e-5)
