"""Argument checks shared by the ``tether.llm`` components: masks, scorers, tokenizer pairs."""

from __future__ import annotations

from typing import Any

import torch

from tether.models import TransformersWrapper
from tether.ops import KL_ESTIMATORS, PADDING_SIDES
from tether.ops.checks import lookup


def check_assistant_rows(assistant: torch.Tensor, source: str) -> None:
    """Every row of an assistant-only batch must hold at least one assistant token.

    A chat without an assistant turn has an all-False assistant mask: with
    ``assistant_only=True`` its log-probs (and any KL built on them) would be a row of zeros
    that silently contributes nothing.
    """
    if assistant.numel() == 0 or bool(assistant.any(-1).all()):
        return
    empty = (~assistant.any(-1)).nonzero().flatten().tolist()
    raise ValueError(
        f"{source}: rows {empty[:8]} (of {assistant.shape[0]}) have no assistant token, e.g. a "
        "chat without an assistant turn; with assistant_only=True they would score to all-zero "
        "rows. Add the assistant reply to those chats, drop them from the batch, or pass "
        "assistant_only=False to score every token."
    )


def check_padding_side(value: Any) -> str:
    lookup(PADDING_SIDES, value, "padding_side")
    return value


def check_estimator(value: Any) -> str:
    lookup(KL_ESTIMATORS, value, "estimator")
    return value


def check_assistant_only(assistant_only: Any, input_mode: str) -> None:
    """``assistant_only=True`` needs chats or tokens: text inputs carry no assistant turns.

    In ``"tokens"`` mode the mask is read from the batch's ``("masks", "all_assistant_mask")``,
    where a generating wrapper or TorchRL's ``ChatEnv`` writes it next to the tokens (a batch
    without one raises a ``KeyError`` naming it at call time).
    """
    if assistant_only and input_mode not in ("history", "tokens"):
        raise ValueError(
            f"assistant_only=True needs a model with input_mode='history' (the assistant mask "
            f"comes from the chat template) or 'tokens' (the mask comes from the batch's "
            f"('masks', 'all_assistant_mask')), got input_mode={input_mode!r}. Pass "
            "assistant_only=False to score every token, or build the scorer with "
            "input_mode='history' (it scores a batch's own tokens and assistant mask when present)."
        )


def check_scorer(model: Any, name: str = "model") -> TransformersWrapper:
    """``model`` must be a ``TransformersWrapper`` set up to score, returning log-probs."""
    if not isinstance(model, TransformersWrapper):
        raise TypeError(
            f"{name}: expected a tether.models.TransformersWrapper, got {type(model).__name__}. "
            f"Wrap the HF model: TransformersWrapper(model, tokenizer, generate=False)."
        )
    if model.generate:
        raise ValueError(
            f"{name}: a model configured to generate (generate=True) was passed as a scorer. "
            f"Build a scoring wrapper over the same weights: TransformersWrapper(model, tokenizer, "
            f"generate=False, temperature=<sampling temperature>); to reuse the log-probs "
            f"recorded while sampling, pass gen_model=None to RetrieveKL instead."
        )
    if not model.return_log_probs:
        raise ValueError(
            f"{name}: expected return_log_probs=True, got False. Build the wrapper with "
            "return_log_probs=True."
        )
    return model


def vocab_size(wrapper: TransformersWrapper) -> int | None:
    """Rows of the wrapped model's output head (its vocabulary), if it has one."""
    model = wrapper.model
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return None if weight is None else int(weight.shape[0])


def check_tokenizers(first: Any, second: Any, names: tuple[str, str]) -> None:
    """Two tokenizers must map the same strings to the same ids (None skips the check)."""
    if first is None or second is None or first is second:
        return
    if len(first) != len(second) or first.get_vocab() != second.get_vocab():
        raise ValueError(
            f"{names[0]} and {names[1]} have different vocabularies ({len(first)} and "
            f"{len(second)} entries): the same token ids would mean different tokens. Use one "
            "tokenizer for the policy and the reference."
        )


def check_pair(gen: TransformersWrapper, ref: TransformersWrapper) -> None:
    """Policy and reference scorers must agree on layout, vocabulary and temperature."""
    if gen.log_probs_key == ref.log_probs_key:
        raise ValueError(
            f"gen_model.log_probs_key and ref_model.log_probs_key are both "
            f"{gen.log_probs_key!r}; expected different keys so the two log-probs never share "
            "an entry. Build the reference with log_probs_key='ref_log_probs'."
        )
    if gen.pad_output != ref.pad_output:
        raise ValueError(
            f"pad_output mismatch: gen_model.pad_output={gen.pad_output}, ref_model.pad_output="
            f"{ref.pad_output}. Build both wrappers with the same pad_output."
        )
    gen_vocab, ref_vocab = vocab_size(gen), vocab_size(ref)
    if gen_vocab is not None and ref_vocab is not None and gen_vocab != ref_vocab:
        raise ValueError(
            f"vocabulary size mismatch: the policy (gen_model) has {gen_vocab} output rows, the "
            f"reference (ref_model) {ref_vocab}. A KL needs one vocabulary; build the reference "
            "from the policy's base checkpoint (e.g. tether.models.frozen_copy)."
        )
    check_tokenizers(gen.tokenizer, ref.tokenizer, ("gen_model.tokenizer", "ref_model.tokenizer"))
    if gen.temperature != ref.temperature:
        raise ValueError(
            f"temperature mismatch: gen_model.temperature={gen.temperature}, "
            f"ref_model.temperature={ref.temperature}. Both log-probs must come from "
            "logits / (sampling temperature); build both wrappers with the same temperature."
        )
