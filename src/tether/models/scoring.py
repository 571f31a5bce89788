"""Padding-free scoring of token sequences under a causal LM.

``score_tokens`` returns ``log p(x_t | x_<t)`` for every position of every row (and optionally
the entropy) without materialising the batch's ``[B, T, V]`` logits: rows are packed end to end
(``tether.models.packing``), or cut into right-padded micro-batches for models packing cannot
serve, and the decoder's last hidden states go through ``tether.ops.token_stats_from_hidden``.
Models whose logits are not a plain linear head of the last hidden state are scored through
their own ``logits`` one micro-batch at a time; which path a model takes is decided once, on a
short probe sequence. Details in the docs (``docs/design.md``).
"""

from __future__ import annotations

import weakref
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tether._compat import checkpointed_layers
from tether.models.packing import packed_kernel, plan_prefix_split, score_packed, score_with_shared_prefix
from tether.models.records import HeadHidden, ScoredTokens
from tether.models.score_plan import (  # noqa: F401 (plan_micro_batches, row_spans, scatter_tokens re-exported)
    Spans,
    TokenSink,
    check_fits_model,
    check_where,
    iter_micro_batches,
    left_aligned,
    plan_micro_batches,
    row_spans,
    scatter_tokens,
)
from tether.ops import TokenStats, token_entropy, token_logprobs
from tether.ops.checks import check_token_ids, whole_number

# Most ``rows * longest_row`` tokens per forward pass. Measured on the embedded model on CPU
# (benchmarks/scoring.py): 1024 scores mixed-length chats about 20 % faster than 4096, which
# pads every row to the batch's longest; per-token cost is flat above a few hundred tokens.
DEFAULT_TOKEN_BUDGET = 1024
# On a GPU the forwards of a GRPO step at these sizes are bound by the host launching kernels
# (H200, 1B Llama, 16 rows x 167 tokens a micro-batch: 0.2 s of GPU time in a 1.9 s loss pass,
# docs/gpu.md), so a micro-batch is one forward and no prompt search syncs column by column.
ACCELERATOR_TOKEN_BUDGET = 32768


def default_layout(device: torch.device) -> tuple[int, bool]:
    """``(token_budget, share_prefix)`` for scoring on ``device`` when the caller names neither:
    small forwards with each distinct prompt run once on a CPU (compute-bound), few large
    forwards elsewhere (launch-bound)."""
    return (DEFAULT_TOKEN_BUDGET, True) if device.type == "cpu" else (ACCELERATOR_TOKEN_BUDGET, False)

# Per model: does ``model(...).logits`` equal ``lm_head(decoder(...))``? Probed once.
_LINEAR_HEAD: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
# Probe logits must agree to float rounding: a soft-cap or scale moves them far more.
_PROBE_RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}


@dataclass(frozen=True)
class CausalLMParts:
    """The pieces of a causal LM that scoring needs: decoder stack and output head."""

    model: nn.Module
    decoder: nn.Module | None
    head: nn.Module


def causal_lm_parts(model: nn.Module) -> CausalLMParts:
    """Split an HF causal LM (optionally wrapped by PEFT) into decoder and output head.

    ``decoder`` is None when the head is not a plain linear map of the decoder output; the
    caller then has to go through ``model(...).logits``.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None or not hasattr(head, "weight"):
        raise TypeError(
            f"model: expected a Hugging Face causal LM with an output embedding (lm_head), "
            f"got {type(model).__name__} whose get_output_embeddings() is {head!r}. "
            "Pass an AutoModelForCausalLM (or a PEFT model wrapping one)."
        )
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else None
    if decoder is not None:
        if inner not in _LINEAR_HEAD:
            _LINEAR_HEAD[inner] = _head_is_linear(inner, decoder, head)
        decoder = decoder if _LINEAR_HEAD[inner] else None
    return CausalLMParts(model=model, decoder=decoder, head=head)


def _head_is_linear(model: nn.Module, decoder: nn.Module, head: nn.Module) -> bool:
    """Whether the model's logits are ``head(decoder(ids))`` on a short probe sequence.

    Run in eval mode (dropout would make two passes differ) without gradients; the training
    flags are restored afterwards. The probe ids are the first few of the vocabulary.
    """
    ids = torch.arange(min(4, head.weight.shape[0]), device=head.weight.device)[None, :]
    modes = {module: module.training for module in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
            mine = head(decoder(input_ids=ids).last_hidden_state).float()
    finally:
        for module, training in modes.items():
            module.training = training
    if logits.shape != mine.shape:
        return False
    rtol = _PROBE_RTOL.get(head.weight.dtype, 1e-2)
    return bool(torch.allclose(logits, mine, rtol=rtol, atol=rtol * float(mine.abs().max().clamp_min(1e-30))))


def score_tokens(
    model: nn.Module,
    tokens: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    with_entropy: bool = False,
    share_prefix: bool = False,
    where: Tensor | None = None,
    keep_hidden: bool = False,
    kl_to: HeadHidden | None = None,
    log_probs: bool = True,
    kl_grad: bool = False,
) -> ScoredTokens:
    """Log-prob (and entropy) of each token given its prefix, padding-free.

    Args:
        model: HF causal LM (or PEFT model). Its train/eval mode is left untouched. A model
            with a ``scoring_view()`` context (``adapter_disabled(policy)``) is scored through
            the module that context yields.
        tokens: ``long [B, T]`` token ids, padded on either side.
        attention_mask: ``bool [B, T]``, one contiguous run of valid tokens per row.
        temperature: the logits are divided by it before the softmax.
        chunk_size: tokens per chunk of the output head (None: a scratch of at most 24 MiB on a CPU,
            the ops default elsewhere; see ``score_plan.default_chunk_size``).
        token_budget: most tokens in one forward pass (its real tokens when rows are packed,
            ``rows * longest_row`` for right-padded micro-batches).
        with_entropy: also return the entropy of ``p(. | x_<t)`` at each position.
        share_prefix: run each distinct prompt prefix through the decoder once when rows
            share it (GRPO groups); see ``tether.models.packing``. Same values up to
            float rounding; falls back to plain scoring when sharing saves little.
        where: ``bool [B, T]`` positions to score (e.g. the assistant mask); the output head
            runs only there and every other position is 0. None: every position.
        keep_hidden: also return the hidden states at ``where`` (``ScoredTokens.hidden``).
        kl_to: hidden states another model kept at the same ``where`` of the same tokens; the
            exact KL from this model to that one per token (``ScoredTokens.exact_kl``, no gradient).
        log_probs: False: only ``kl_to``'s exact KL (``ScoredTokens.log_probs`` is None).
        kl_grad: the exact KL is differentiable w.r.t. this model's parameters (grad mode on),
            for a loss term; the reference stays a constant.

    Returns:
        ``ScoredTokens`` with ``log_probs [B, T]`` (and ``entropy [B, T]``), 0 at the first
        valid token of each row, at padding and outside ``where``. Differentiable w.r.t. the
        model's parameters when grad mode is on.
    """
    spans = _checked(model, tokens, attention_mask, token_budget, where)
    return _score_checked(model, tokens, spans, temperature=temperature, chunk_size=chunk_size,
                          token_budget=token_budget, with_entropy=with_entropy, share_prefix=share_prefix, where=where,
                          keep_hidden=keep_hidden, kl_to=kl_to, log_probs=log_probs, kl_grad=kl_grad)


def _checked(model: nn.Module, tokens: Tensor, attention_mask: Tensor, token_budget: int,
             where: Tensor | None) -> Spans:
    """Every check of a scoring call's inputs, once; the rows' spans every pass then reads."""
    if tokens.shape != attention_mask.shape or tokens.ndim != 2:
        raise ValueError(
            f"tokens/attention_mask: expected two [B, T] tensors of the same shape, got "
            f"{tuple(tokens.shape)} and {tuple(attention_mask.shape)}."
        )
    whole_number("token_budget", token_budget, low=1, fix="It caps the tokens of one forward pass.")
    check_token_ids("tokens", tokens)
    check_where(where, tokens)
    spans = Spans.of(attention_mask)
    check_fits_model(model, tokens, spans.mask)
    return spans


def _score_checked(model: nn.Module, tokens: Tensor, spans: Spans, *, temperature: float, chunk_size: int | None,
                   token_budget: int, with_entropy: bool, share_prefix: bool, where: Tensor | None,
                   keep_hidden: bool, kl_to: HeadHidden | None, log_probs: bool, kl_grad: bool = False) -> ScoredTokens:
    """``score_tokens`` on inputs ``_checked`` has passed (``score_tokens`` documents the arguments)."""
    with ExitStack() as stack:
        view = getattr(model, "scoring_view", None)
        if view is not None:  # a model that is scored through another (adapter_disabled(policy))
            model = stack.enter_context(view())
        parts = causal_lm_parts(model)
        if parts.decoder is None and (keep_hidden or kl_to is not None):
            raise TypeError(
                f"model: {type(model).__name__} has a non-linear output head (soft-capping or logit scaling); "
                "hidden states and the exact KL from them need a plain linear head. Use the sampled KL instead."
            )
        sink = TokenSink(parts.head, tuple(tokens.shape), where=where, temperature=temperature, chunk_size=chunk_size,
                         with_entropy=with_entropy, keep_hidden=keep_hidden, kl_to=kl_to, log_probs=log_probs,
                         kl_grad=kl_grad)
        if not (share_prefix and _score_shared(parts, tokens, spans, token_budget, sink)):
            _score(parts, tokens, spans, token_budget, sink)
        return sink.result()


def _score_shared(parts: CausalLMParts, tokens: Tensor, spans: Spans, token_budget: int, sink: TokenSink) -> bool:
    """Score through the shared-prefix split; False (nothing scored) when it does not apply."""
    if parts.decoder is None:
        return False
    if torch.is_grad_enabled() and checkpointed_layers(parts.decoder):
        # A checkpointed layer drops the KV cache the suffixes would be scored on.
        return False
    # Planned on rows moved to column 0: a left-padded batch shifts each copy of a group's prompt by
    # its own answer's padding, and a cut is one column for all rows.
    aligned, mask, source = left_aligned(tokens, spans)
    split = plan_prefix_split(aligned, mask)
    if split is None:
        return False
    with sink.relaid(source):
        return score_with_shared_prefix(parts.decoder, aligned, mask, split, token_budget=token_budget, sink=sink)


def _score(parts: CausalLMParts, tokens: Tensor, spans: Spans, token_budget: int, sink: TokenSink) -> None:
    kernel = None if parts.decoder is None else packed_kernel(parts.model)
    if kernel is not None and not (
        torch.is_grad_enabled() and checkpointed_layers(parts.decoder)  # a re-run forward would attend across rows
    ):
        score_packed(parts.decoder, kernel, tokens, spans, sink, token_budget)
        return
    device = parts.head.weight.device
    for mb in iter_micro_batches(tokens, spans, token_budget, device):
        labels = mb.ids[:, 1:]
        if parts.decoder is not None:
            hidden = parts.decoder(input_ids=mb.ids, attention_mask=mb.valid.long(), use_cache=False).last_hidden_state
            sink.add(hidden[:, :-1][mb.keep], labels[mb.keep], mb.flat_index)
            continue
        logits = parts.model(input_ids=mb.ids, attention_mask=mb.valid.long(), use_cache=False).logits[:, :-1]
        kwargs = {"temperature": sink.kwargs["temperature"], "chunk_size": sink.kwargs.get("chunk_size")}
        entropy = token_entropy(logits, **kwargs)[mb.keep] if sink.with_entropy else None
        sink.add_values(TokenStats(token_logprobs(logits, labels, **kwargs)[mb.keep], entropy), mb.flat_index)


@torch.no_grad()
def exact_kl_tokens(
    model: nn.Module,
    reference: nn.Module,
    tokens: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    where: Tensor | None = None,
) -> Tensor:
    """Exact KL(pi(.|x_<t) || pi_ref(.|x_<t)) at every position ``t`` of ``tokens [B, T]``.

    Aligned like log-probs: entry ``t`` is the KL of the distributions that predict token
    ``t``; 0 at each row's first token and at padding. Full-vocabulary, never ``[B, T, V]``.
    ``where`` (``bool [B, T]``, e.g. the assistant mask) limits the vocabulary-wide work to
    those positions (0 elsewhere). Two scoring passes: the reference's keeps its hidden
    states at ``where``, the model's compares its own with them (``score_tokens(kl_to=)``).
    """
    spans = _checked(model, tokens, attention_mask, token_budget, where)
    check_fits_model(reference, tokens, spans.mask)
    scored = spans.mask.clone()
    scored[torch.arange(scored.shape[0]), spans.start] = False  # a row's first token has no prediction
    where = scored if where is None else where & scored
    common = {"temperature": temperature, "chunk_size": chunk_size, "token_budget": token_budget, "where": where,
              "with_entropy": False, "share_prefix": False}
    ref = _score_checked(reference, tokens, spans, keep_hidden=True, kl_to=None, log_probs=True, **common)
    return _score_checked(model, tokens, spans, keep_hidden=False, kl_to=ref.hidden, log_probs=False, **common).exact_kl
