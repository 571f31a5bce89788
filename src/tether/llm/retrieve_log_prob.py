"""``RetrieveLogProb``: per-token log-probs of the sequences of a batch under one model.

When the batch already holds ``("tokens", "full")`` with ``("masks", "all_attention_mask")``,
those exact ids are scored (re-rendering decoded text need not give back the sampled ids);
otherwise the wrapper's own input is rendered or encoded, and the tokens and masks found are
written to the batch so that the reference scorer and ``KLComputation`` see the same ones.

Departures from TorchRL: ``detach`` is honoured (TorchRL ignored it); the assistant
mask includes each turn's end-of-turn token; scoring is padding-free and never builds
``[B, T, V]`` logits; ``assistant_only=True`` takes a tokens-mode model too, reading the
batch's assistant mask (as TorchRL's LLM ``KLRewardTransform`` does; its ``RetrieveLogProb``
refused it). A text-mode model is refused at construction, as in TorchRL.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import Tensor

from tether.llm._checks import (
    check_assistant_only,
    check_assistant_rows,
    check_padding_side,
    check_scorer,
    check_tokenizers,
)
from tether.llm._token_grid import (
    ASSISTANT_KEY,
    ATTENTION_KEY,
    TOKENS_KEY,
    as_key,
    on_rows,
    place,
    target_of,
)
from tether.models import TransformersWrapper, tokenize_chats
from tether.models.batch_io import get_entry, has_key, listed_keys, read_chats, read_ragged, write_ragged
from tether.ops import padded_to_nested
from tether.ops.masks import pad_rows

__all__ = ["RetrieveLogProb"]


@dataclass(frozen=True)
class ScoredBatch:
    """Tokens of a batch with their log-probs under the model.

    ``from_batch`` rows were read from the TensorDict and keep its layout (right-padded
    grids of nested rows when ``nested``); other rows are new and laid out by the caller.
    """

    ids: Tensor  # long [B, T]
    mask: Tensor  # bool [B, T]
    assistant: Tensor | None  # bool [B, T]
    log_probs: Tensor  # [B, T]
    nested: bool
    from_batch: bool


class RetrieveLogProb(TensorDictModuleBase):
    """Write ``log p(x_t | x_<t)`` of every token of a batch under ``model``.

    Args:
        model: a scoring ``tether.models.TransformersWrapper`` (``generate=False``,
            ``return_log_probs=True``). Its temperature should be the sampling temperature.

    Keyword Args:
        log_probs_full_key: where the log-probs go; default ``(model.log_probs_key, "full")``.
        assistant_only: zero the log-probs outside ``("masks", "all_assistant_mask")``.
            Needs ``model.input_mode`` ``"history"`` or ``"tokens"`` (a ``ValueError`` at
            construction for ``"text"``); the mask comes from the chat template, or from the
            batch when it already holds tokens (a ``KeyError`` at call time if it has none).
        tokenizer_kwargs: extra ``apply_chat_template`` arguments (template variables)
            used when chats are rendered here.
        tokenizer: tokenizer rendering the chats; default ``model.tokenizer``. Must share
            the model tokenizer's vocabulary.
        detach: True (default) scores under ``torch.no_grad()``: no graph is built. False
            keeps the autograd graph to the model's parameters (under the caller's grad mode).
        device: device the log-probs are written on; default the TensorDict's device, else
            that of the tokens.
        padding_side: side of the padding of padded outputs laid out here; outputs for
            tokens read from the batch follow the batch's own layout.

    Output (``td["next"]`` when the TensorDict has a ``"next"`` entry, else the root):
    ``log_probs_full_key`` as ``[B, T]`` aligned with ``("tokens", "full")`` (padded) or
    jagged ``[B, j]`` (``model.pad_output=False``); 0 at each row's first token, on padding
    and, with ``assistant_only``, outside the assistant mask.

    Examples:
        >>> import torch
        >>> from tether.llm import RetrieveLogProb, chat_batch
        >>> from tether.models import TransformersWrapper
        >>> from tether.models.tiny import byte_tokenizer, tiny_causal_lm
        >>> tok = byte_tokenizer()
        >>> ref = TransformersWrapper(tiny_causal_lm(tok, seed=1), tok, generate=False, log_probs_key="ref_log_probs")
        >>> batch = chat_batch([[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]])
        >>> out = RetrieveLogProb(ref)(batch)
        >>> out["ref_log_probs", "full"].shape  # one per token of the rendered chat
        torch.Size([1, 26])
        >>> int((out["ref_log_probs", "full"] != 0).sum())  # assistant_only: "4" and its end-of-turn token
        2
    """

    def __init__(
        self,
        model: TransformersWrapper,
        *,
        log_probs_full_key: NestedKey | None = None,
        assistant_only: bool = True,
        tokenizer_kwargs: Mapping[str, Any] | None = None,
        tokenizer: Any = None,
        detach: bool = True,
        device: torch.device | str | None = None,
        padding_side: str = "left",
    ) -> None:
        super().__init__()
        self.model = check_scorer(model)
        check_assistant_only(assistant_only, model.input_mode)
        default_key = (model.log_probs_key, "full")
        self.log_probs_full_key = as_key("log_probs_full_key", log_probs_full_key or default_key)
        if tokenizer is not None:
            check_tokenizers(tokenizer, model.tokenizer, ("tokenizer", "model.tokenizer"))
        self.tokenizer = tokenizer
        self.tokenizer_kwargs = dict(tokenizer_kwargs or {})
        self.assistant_only = bool(assistant_only)
        self.detach = bool(detach)
        self.device = torch.device(device) if device is not None else None
        self.padding_side = check_padding_side(padding_side)
        self.in_keys = [(model.input_mode, "full")]
        self.out_keys = [self.log_probs_full_key]

    # ------------------------------------------------------------------ forward
    def forward(self, td: TensorDictBase) -> TensorDictBase:
        return on_rows(td, self._forward)

    def _forward(self, td: TensorDictBase) -> TensorDictBase:
        with torch.no_grad() if self.detach else nullcontext():
            scored = self._score(td)
        log_probs = scored.log_probs
        if self.assistant_only:
            log_probs = torch.where(scored.assistant.to(log_probs.device), log_probs, 0.0)
        device = self.device or td.device or scored.ids.device
        log_probs = place(log_probs, device)
        target = target_of(td)
        if scored.from_batch:
            values = padded_to_nested(log_probs, scored.mask.to(device)) if scored.nested else log_probs
            target.set(self.log_probs_full_key, values)
            return td
        layout = dict(pad_output=self.model.pad_output, padding_side=self.padding_side)
        mask = scored.mask.to(device)
        write_ragged(target, self.log_probs_full_key, log_probs, mask, **layout)
        write_ragged(td, TOKENS_KEY, scored.ids.to(device), mask, mask_key=ATTENTION_KEY,
                     pad_value=self.model.pad_id, **layout)
        if scored.assistant is not None:
            write_ragged(td, ASSISTANT_KEY, scored.assistant.to(device) & mask, mask, **layout)
        return td

    # ------------------------------------------------------------------ scoring
    def _score(self, td: TensorDictBase) -> ScoredBatch:
        if has_key(td, TOKENS_KEY) and (has_key(td, ATTENTION_KEY) or self.model.input_mode == "tokens"):
            scored = self._score_batch_tokens(td)
        elif self.model.input_mode == "history":
            scored = self._score_chats(td)
        else:
            scored = self._score_with_wrapper(td)
        if self.assistant_only and scored.assistant is None:
            raise KeyError(
                f"{ASSISTANT_KEY!r}: assistant_only=True needs an assistant mask, but the batch "
                f"has none next to its tokens and input_mode={self.model.input_mode!r} gives "
                f"none. Present keys: {listed_keys(td)}. Score chats with "
                "input_mode='history', add the mask to the batch, or pass assistant_only=False."
            )
        if self.assistant_only:
            check_assistant_rows(scored.assistant, repr(ASSISTANT_KEY))
        return scored

    def _score_batch_tokens(self, td: TensorDictBase) -> ScoredBatch:
        ids, mask = read_ragged(td, TOKENS_KEY, ATTENTION_KEY)
        nested = get_entry(td, TOKENS_KEY).is_nested
        assistant = None
        found = read_ragged(td, ASSISTANT_KEY, ATTENTION_KEY, required=False)
        if found is not None:
            assistant = found[0].bool()
            if assistant.shape != ids.shape or (nested and not torch.equal(found[1], mask)):
                raise ValueError(
                    f"{ASSISTANT_KEY!r}: expected a mask laid out like {TOKENS_KEY!r} (shape "
                    f"{tuple(ids.shape)}), got shape {tuple(assistant.shape)}. Write the tokens "
                    "and their masks with the same pad_output and padding side."
                )
            assistant = assistant & mask
        log_probs = self._log_probs(ids.long(), mask, assistant)
        return ScoredBatch(ids, mask, assistant, log_probs, nested=nested, from_batch=True)

    def _score_chats(self, td: TensorDictBase) -> ScoredBatch:
        chats = read_chats(td, ("history", "full"))
        tokenizer = self.tokenizer if self.tokenizer is not None else self.model.tokenizer
        enc = tokenize_chats(tokenizer, chats, tokenizer_kwargs=self.tokenizer_kwargs)
        # Right-padded here; write_ragged lays the outputs out on padding_side afterwards.
        ids = pad_rows(enc.input_ids, padding_value=self.model.pad_id)
        assistant = pad_rows(enc.assistant_mask, padding_value=False).values
        log_probs = self._log_probs(ids.values, ids.mask, assistant)
        return ScoredBatch(ids.values, ids.mask, assistant, log_probs, nested=False, from_batch=False)

    def _log_probs(self, ids: Tensor, mask: Tensor, assistant: Tensor | None) -> Tensor:
        # Assistant-only values are zeroed elsewhere anyway: run the output head only where they are kept.
        where = assistant if self.assistant_only and assistant is not None else None
        return self.model.score(ids, mask, where=where).log_probs

    def _score_with_wrapper(self, td: TensorDictBase) -> ScoredBatch:
        wanted = [(self.model.input_mode, "full"), (self.model.input_mode, "prompt")]
        # The wrapper raises a KeyError naming (input_mode, "full") when it is missing.
        out = self.model(td.select(*[k for k in wanted if has_key(td, k)]))
        ids, mask = read_ragged(out, TOKENS_KEY, ATTENTION_KEY)
        log_probs, _ = read_ragged(out, (self.model.log_probs_key, "full"), ATTENTION_KEY)
        found = read_ragged(out, ASSISTANT_KEY, ATTENTION_KEY, required=False)
        assistant = None if found is None else found[0].bool() & mask
        return ScoredBatch(ids, mask, assistant, log_probs, nested=False, from_batch=False)

    def extra_repr(self) -> str:
        return (
            f"log_probs_full_key={self.log_probs_full_key!r}, assistant_only={self.assistant_only}, "
            f"detach={self.detach}, padding_side={self.padding_side!r}"
        )
