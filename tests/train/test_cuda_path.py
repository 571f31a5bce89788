"""The CUDA path (issue 16): bf16 weights with float32 vocabulary reductions, SDPA attention,
and a decode loop whose only host syncs are the finished-row checks. The CPU tests check
what holds on any device; the others skip without a GPU."""

from __future__ import annotations

import collections
import linecache
import warnings
from pathlib import Path

import pytest
import torch

from tether._compat import attention_implementation
from tether.models.sampling import sample_responses
from tether.models.scoring import score_tokens
from tether.models.tiny import byte_tokenizer, tiny_causal_lm
from tether.ops import token_stats_from_hidden
from tether.train.config import TrainConfig
from tether.train.run import build_models

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_bf16_inputs_reduce_over_the_vocabulary_in_float32():
    """The same bf16 values upcast by hand give the same log-probs and entropy: the head's
    softmax never runs in bf16 (whose 8-bit mantissa would move a log-prob by ~1e-2)."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 5, 16).bfloat16(), torch.randn(300, 16).bfloat16()
    labels = torch.randint(0, 300, (2, 5))
    stats = token_stats_from_hidden(hidden, weight, labels, with_entropy=True, chunk_size=4)
    assert stats.log_probs.dtype == torch.float32 and stats.entropy.dtype == torch.float32
    logits = (hidden.float() @ weight.float().T).log_softmax(-1)
    torch.testing.assert_close(stats.log_probs, logits.gather(-1, labels[..., None]).squeeze(-1), rtol=0, atol=2e-2)
    torch.testing.assert_close(stats.entropy, -(logits.exp() * logits).sum(-1), rtol=0, atol=2e-2)


def test_models_load_with_sdpa_attention(tmp_path):
    models = build_models(TrainConfig(model="tiny", device="cpu", lora_rank=0, out=str(tmp_path)))
    assert attention_implementation(models.policy) == "sdpa"


@needs_cuda
def test_bf16_on_cuda_scores_in_float32_with_sdpa(tmp_path):
    models = build_models(TrainConfig(model="tiny", device="cuda", dtype="bfloat16", out=str(tmp_path)))
    assert attention_implementation(models.policy) == "sdpa"
    tokens = torch.randint(0, 250, (3, 9), device="cuda")
    stats = score_tokens(models.policy, tokens, torch.ones_like(tokens, dtype=torch.bool))
    assert stats.log_probs.dtype == torch.float32
    assert next(models.policy.parameters()).dtype in (torch.bfloat16, torch.float32)  # LoRA factors stay float32


@needs_cuda
@pytest.mark.parametrize("static_cache", [False, None])
def test_decode_loop_syncs_only_for_the_finished_row_checks(static_cache):
    """No row ends (no eos id matches), so each of the 16 steps has the two checks (all ended?
    any ended?) and, in the dynamic loop, transformers' own (SDPA's mask: is the padding mask all
    ones?, once per forward); the rest (argument checks, prefill, the final width) is bounded. A
    line that syncs on every step is one of those, read from its source (seen on an H200: an index
    assignment of a Python number synced once a step until it became ``index_fill_``). None is
    the GPU's default, the static buffers' replayed graph."""
    tok = byte_tokenizer()
    model = tiny_causal_lm(tok, dtype=torch.bfloat16).cuda()
    prompts = torch.randint(0, 250, (4, 6), device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            sample_responses(model, prompts, torch.ones_like(prompts, dtype=torch.bool), max_new_tokens=16,
                             eos_ids=[-1], pad_id=tok.pad_token_id, generator=generator, static_cache=static_cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    sources = collections.Counter((w.filename, w.lineno) for w in syncs)
    named = {f"{Path(f).name}:{n}": count for (f, n), count in sources.items()}
    every_step = [(f, n) for (f, n), count in sources.items() if count > 3]
    for f, n in every_step:
        line = linecache.getline(f, n)
        assert "ended" in line or Path(f).name == "masking_utils.py", f"{Path(f).name}:{n} syncs every step: {line!r}"
    assert len(syncs) <= 3 * 16 + 12, f"{len(syncs)} syncs, by the line that made them: {named}"
