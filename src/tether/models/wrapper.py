"""``TransformersWrapper``: a TensorDict module over any Hugging Face causal LM.

One object samples responses (``generate=True``) or scores given sequences
(``generate=False``) from chats (``input_mode="history"``), strings (``"text"``) or token
ids (``"tokens"``), and writes tokens, masks, texts and per-token log-probs under the keys
the rest of tether reads (SPEC section 4):

``("tokens", "prompt"|"response"|"full")``, ``("masks", "all_attention_mask")``,
``("masks", "all_assistant_mask")``, ``("text", ...)``, ``(log_probs_key, "full")``,
``(log_probs_key, "response")``.

Log-probs are aligned with the tokens (``log_probs[:, t] = log p(x_t | x_<t)``, 0 where
nothing is predicted) and come from ``softmax(logits / temperature)``. Sampling uses
tether's own decode loop (``tether.models.sampling``) so the recorded sampling log-probs are
read off the distribution the tokens were drawn from; scoring is padding-free and never
builds ``[B, T, V]`` logits (``tether.models.scoring``).

In generate mode the assistant mask marks the sampled response only: earlier assistant turns
inside a multi-turn prompt were not sampled by this policy and carry no sampling log-prob,
so training on them would use a wrong importance ratio.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import Tensor, nn

from tether.models.batch_io import (
    read_chats, read_ragged, read_strings, refuse_retokenising, write_objects, write_ragged,
)
from tether.models.chat import tokenize_chats
from tether.models.records import HeadHidden, ScoredTokens, StepRecord
from tether.models.sampling import check_sampling_options, sample_responses
from tether.models.scoring import default_layout, score_tokens
from tether.models.special_ids import resolve_eos_ids, resolve_pad_id
from tether.ops import PADDING_SIDES
from tether.ops.checks import check_token_ids, lookup
from tether.ops.masks import pad_rows, position_ids, repack

INPUT_MODES = ("history", "text", "tokens")
_GENERATE_OPTIONS = {"max_new_tokens", "top_k", "top_p", "do_sample", "generator", "draw"}
_DEFAULT_MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class EncodedBatch:
    """Token ids of a batch with their valid mask, plus the extra per-mode information."""

    ids: Tensor  # long [B, T]
    mask: Tensor  # bool [B, T]
    assistant_mask: Tensor | None = None  # bool [B, T]
    prompt_lengths: Tensor | None = None  # long [B]: tokens of each row that are prompt


@dataclass(frozen=True)
class _Draw:
    """Answers sampled after a left-padded prompt. ``tokens``, ``mask``, ``assistant_mask`` and
    ``log_probs`` are ``[B, P + N]``: the prompt's columns, then the answer's (one run per row)."""

    response_ids: Tensor  # long [B, N]
    response_mask: Tensor  # bool [B, N]
    response_log_probs: Tensor  # [B, N]
    finished: Tensor  # bool [B]
    tokens: Tensor
    mask: Tensor
    assistant_mask: Tensor
    log_probs: Tensor


def _prompt_mask_key(td: TensorDictBase) -> tuple[str, str]:
    """Where the mask of ``("tokens", "prompt")`` lives.

    ``("masks", "prompt_attention_mask")`` when present; else, before anything was generated
    (no ``("tokens", "full")``), ``("masks", "all_attention_mask")``, where TorchRL stores
    the mask of tokens-mode prompts. Without either, every prompt position counts.
    """
    keys = td.keys(include_nested=True)
    if ("masks", "prompt_attention_mask") not in keys and ("tokens", "full") not in keys:
        if ("masks", "all_attention_mask") in keys:
            return ("masks", "all_attention_mask")
    return ("masks", "prompt_attention_mask")


def _checked_options(tokenizer: Any, input_mode: str, temperature: float, padding_side: str,
                     generate_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The wrapper's arguments checked (typed errors naming each); returns the sampling options."""
    lookup(dict.fromkeys(INPUT_MODES), input_mode, "input_mode")
    if input_mode != "tokens" and tokenizer is None:
        raise ValueError(
            f"tokenizer: input_mode={input_mode!r} needs a tokenizer to render and encode "
            "inputs, got None. Pass the model's tokenizer or use input_mode='tokens'."
        )
    lookup(PADDING_SIDES, padding_side, "padding_side")
    unknown = set(generate_kwargs or {}) - _GENERATE_OPTIONS
    if unknown:
        raise ValueError(
            f"generate_kwargs: unsupported options {sorted(unknown)}; supported: "
            f"{sorted(_GENERATE_OPTIONS)}."
        )
    options = {"max_new_tokens": _DEFAULT_MAX_NEW_TOKENS, **(generate_kwargs or {})}
    check_sampling_options(temperature=temperature, max_new_tokens=options["max_new_tokens"],
                           top_k=options.get("top_k"), top_p=options.get("top_p"))
    return options


class TransformersWrapper(TensorDictModuleBase):
    """Sample from or score with an HF causal LM on TensorDicts.

    Args:
        model: any ``AutoModelForCausalLM`` (or PEFT model). Its train/eval mode is not
            changed; keep it in eval mode for RL so that sampling and scoring agree.
        tokenizer: required for ``"history"`` and ``"text"`` modes; gives eos and pad ids.
        input_mode: ``"history"`` (chats, rendered by the tokenizer's own chat template),
            ``"text"`` or ``"tokens"``.
        generate: True samples a response after ``(input_mode, "prompt")``; False scores
            ``(input_mode, "full")``.
        return_log_probs: write ``(log_probs_key, "full"|"response")``.
        pad_output: padded tensors with masks (True) or jagged nested tensors (False).
        log_probs_key: first element of the log-prob keys.
        temperature: sampling temperature, also used for every log-prob.
        generate_kwargs: ``max_new_tokens`` (default 256), ``top_k``, ``top_p``,
            ``do_sample`` (default True), ``generator`` (a ``torch.Generator``), ``draw`` (a
            ``tether.models.sampling.RowDraw`` shared by several processes; None samples alone).
        chunk_size: tokens per chunk of the output-head computation.
        device: device the model runs on (default: where its parameters are).
        padding_side: side of the padding in padded outputs.
        token_budget: most tokens in one scoring forward pass (real tokens when packed,
            ``rows * longest_row`` when right-padded; see ``score_tokens``). None: by the
            model's device (``tether.models.scoring.default_layout``).
        share_prefix: when rows share a prompt (GRPO groups), score each distinct prompt
            once and the responses on top of its cache (``tether.models.packing``).
            None: on a CPU only (``default_layout``).
        eos_token_id, pad_token_id: override the ids found on the tokenizer / model configs
            (``tether.models.special_ids``); a model with no pad id anywhere needs
            ``pad_token_id`` (the eos id is a common choice).
    """

    scores_positions = True  # score() takes where= and kl_to= (tether.models.records.Scorer)

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        *,
        input_mode: str = "history",
        generate: bool = True,
        return_log_probs: bool = True,
        pad_output: bool = True,
        log_probs_key: str = "log_probs",
        temperature: float = 1.0,
        generate_kwargs: dict[str, Any] | None = None,
        chunk_size: int | None = None,
        device: torch.device | str | None = None,
        padding_side: str = "left",
        token_budget: int | None = None,
        share_prefix: bool | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        super().__init__()
        self.generate_kwargs = _checked_options(tokenizer, input_mode, temperature, padding_side, generate_kwargs)
        self.model = model
        self.tokenizer = tokenizer
        self.input_mode = input_mode
        self.generate = generate
        self.return_log_probs = return_log_probs
        self.pad_output = pad_output
        self.log_probs_key = log_probs_key
        self.temperature = float(temperature)
        self.chunk_size = chunk_size
        self.padding_side = padding_side
        self.token_budget = token_budget
        self.share_prefix = share_prefix
        self._device = torch.device(device) if device is not None else None
        self.eos_ids = set(resolve_eos_ids(eos_token_id, model, tokenizer, owner="TransformersWrapper"))
        self.pad_id = resolve_pad_id(pad_token_id, model, tokenizer, owner="TransformersWrapper")
        stage = "prompt" if generate else "full"
        self.in_keys = [(input_mode, stage)]
        out = [("tokens", "full"), ("masks", "all_attention_mask"), ("masks", "all_assistant_mask")]
        if generate:
            out += [("tokens", "prompt"), ("tokens", "response"), ("text", "response")]
        if return_log_probs:
            out += [(log_probs_key, "full")] + ([(log_probs_key, "response")] if generate else [])
        self.out_keys = out

    @property
    def device(self) -> torch.device:
        if self._device is not None:
            return self._device
        return next(self.model.parameters()).device

    # ---------------------------------------------------------------- public API
    def forward(self, td: TensorDictBase) -> TensorDictBase:
        if self.generate:
            self._generate(td)
        else:
            self._score(td)
        return td

    def score(self, tokens: Tensor, attention_mask: Tensor, *, with_entropy: bool = False, where: Tensor | None = None,
              keep_hidden: bool = False, kl_to: HeadHidden | None = None, log_probs: bool = True,
              kl_grad: bool = False) -> ScoredTokens:
        """Per-token log-probs (and entropies) of ``tokens [B, T]`` under this model.

        ``where``, ``keep_hidden``, ``kl_to``, ``log_probs`` and ``kl_grad`` are those of
        ``tether.models.scoring.score_tokens`` (score only some positions, keep their hidden
        states, exact KL against another model's, skip the log-probs). Differentiable when grad
        mode is on; the result lives on the model's device.
        """
        budget, share = default_layout(self.device)
        return score_tokens(
            self.model,
            tokens.to(self.device),
            attention_mask.to(self.device),
            temperature=self.temperature,
            chunk_size=self.chunk_size,
            token_budget=budget if self.token_budget is None else self.token_budget,
            with_entropy=with_entropy,
            share_prefix=share if self.share_prefix is None else self.share_prefix,
            where=None if where is None else where.to(self.device),
            keep_hidden=keep_hidden,
            kl_to=kl_to,
            log_probs=log_probs,
            kl_grad=kl_grad,
        )

    # ---------------------------------------------------------------- encoding
    def _encode_texts(self, texts: list[str], padding_side: str) -> tuple[Tensor, Tensor]:
        rows = [torch.tensor(self.tokenizer(t)["input_ids"], dtype=torch.long) for t in texts]
        padded = pad_rows(rows, padding_value=self.pad_id, padding_side=padding_side)
        return padded.values, padded.mask

    def _encode(self, td: TensorDictBase, stage: str, padding_side: str) -> EncodedBatch:
        """Token ids of ``(input_mode, stage)`` laid out with ``padding_side`` padding."""
        readers: dict[str, Callable[[TensorDictBase, str, str], EncodedBatch]] = {
            "history": self._encode_history,
            "text": self._encode_text,
            "tokens": self._encode_tokens,
        }
        return readers[self.input_mode](td, stage, padding_side)

    def _encode_history(self, td: TensorDictBase, stage: str, padding_side: str) -> EncodedBatch:
        return self._encode_chats(read_chats(td, ("history", stage)), stage, padding_side)

    def _encode_chats(self, chats: list[list[dict[str, Any]]], stage: str, padding_side: str) -> EncodedBatch:
        enc = tokenize_chats(self.tokenizer, chats, add_generation_prompt=stage == "prompt")
        ids = pad_rows(enc.input_ids, padding_value=self.pad_id, padding_side=padding_side)
        assistant = pad_rows(enc.assistant_mask, padding_value=False, padding_side=padding_side)
        return EncodedBatch(ids=ids.values, mask=ids.mask, assistant_mask=assistant.values)

    def _encode_text(self, td: TensorDictBase, stage: str, padding_side: str) -> EncodedBatch:
        ids, mask = self._encode_texts(read_strings(td, ("text", stage)), padding_side)
        prompt_lengths = None
        if stage == "full" and ("text", "prompt") in td.keys(include_nested=True):
            p_ids, p_mask = self._encode_texts(read_strings(td, ("text", "prompt")), "right")
            prompt_lengths = p_mask.sum(-1)
            full_right, _ = repack(ids, mask, "right")
            head = full_right[:, : p_ids.shape[-1]]
            if head.shape != p_ids.shape or bool(((head != p_ids) & p_mask).any()):
                raise ValueError(
                    "('text', 'prompt'): the tokenised prompt is not a token prefix of the "
                    "tokenised ('text', 'full'), so the response cannot be located. Use "
                    "input_mode='tokens' with explicit prompt tokens."
                )
        return EncodedBatch(ids=ids, mask=mask, prompt_lengths=prompt_lengths)

    def _encode_tokens(self, td: TensorDictBase, stage: str, padding_side: str) -> EncodedBatch:
        mask_key = ("masks", "all_attention_mask") if stage == "full" else _prompt_mask_key(td)
        ids, mask = read_ragged(td, ("tokens", stage), mask_key)
        check_token_ids(repr(("tokens", stage)), ids)
        ids, mask = repack(ids, mask, padding_side)
        assistant = None
        prompt_lengths = None
        if stage == "full":
            found = read_ragged(td, ("masks", "all_assistant_mask"), mask_key, required=False)
            if found is not None:
                assistant, _ = repack(found[0].bool(), found[1], padding_side)
            prompt = read_ragged(td, ("tokens", "prompt"), ("masks", "prompt_attention_mask"), required=False)
            if prompt is not None:
                prompt_lengths = prompt[1].sum(-1)
        return EncodedBatch(ids=ids.long(), mask=mask, assistant_mask=assistant, prompt_lengths=prompt_lengths)

    # ---------------------------------------------------------------- generation
    def sample_record(self, prompts: Sequence[list[dict[str, Any]]] | Sequence[str],
                      group_ids: Tensor | None = None) -> StepRecord:
        """Sample one answer to each prompt into a ``StepRecord`` (no TensorDict on the way).

        ``prompts`` are chats in ``"history"`` mode, strings in ``"text"`` mode; ``group_ids``
        ``long [B]`` (default: each answer its own group). The record's grid is laid out as
        ``forward`` writes ``("tokens", "full")``: one run per row, padded on ``padding_side``.
        """
        if self.input_mode == "tokens":
            raise ValueError("sample_record: prompts are chats ('history' mode) or strings ('text' mode), but this "
                             "wrapper has input_mode='tokens'; call it on a TensorDict with ('tokens', 'prompt').")
        prompt = (self._encode_chats(list(prompts), "prompt", "left") if self.input_mode == "history"
                  else EncodedBatch(*self._encode_texts(list(prompts), "left")))
        draw = self._draw(prompt)
        tokens, mask = repack(draw.tokens, draw.mask, self.padding_side, padding_value=self.pad_id)
        return StepRecord(
            tokens=tokens, attention_mask=mask, assistant_mask=repack(draw.assistant_mask, draw.mask, self.padding_side)[0],
            group_ids=torch.arange(len(prompts)) if group_ids is None else group_ids,
            sample_log_probs=repack(draw.log_probs, draw.mask, self.padding_side)[0],
            responses=self._decode(draw.response_ids, draw.response_mask, skip_special_tokens=True),
        )

    def _draw(self, prompt: EncodedBatch) -> _Draw:
        """Answers to the left-padded ``prompt``, on the prompt's device."""
        opts = self.generate_kwargs
        sample = sample_responses(
            self.model,
            prompt.ids.to(self.device),
            prompt.mask.to(self.device),
            max_new_tokens=opts["max_new_tokens"],
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
            temperature=self.temperature,
            top_k=opts.get("top_k"),
            top_p=opts.get("top_p"),
            do_sample=bool(opts.get("do_sample", True)),
            generator=opts.get("generator"),
            draw=opts.get("draw"),
        )
        ids, mask, log_probs = (x.to(prompt.ids.device) for x in (sample.tokens, sample.mask, sample.log_probs))
        return _Draw(ids, mask, log_probs, sample.finished.to(prompt.ids.device),
                     tokens=torch.cat([prompt.ids, ids], 1), mask=torch.cat([prompt.mask, mask], 1),
                     assistant_mask=torch.cat([torch.zeros_like(prompt.mask), mask], 1),
                     log_probs=torch.cat([log_probs.new_zeros(prompt.ids.shape), log_probs], 1))

    def _generate(self, td: TensorDictBase) -> None:
        prompt = self._encode(td, "prompt", "left")
        if td.device is not None:
            prompt = EncodedBatch(prompt.ids.to(td.device), prompt.mask.to(td.device))
        draw = self._draw(prompt)
        self._write_common(td, draw.tokens, draw.mask, draw.assistant_mask)
        ragged = dict(pad_output=self.pad_output, padding_side=self.padding_side)
        write_ragged(td, ("tokens", "prompt"), prompt.ids, prompt.mask, pad_value=self.pad_id, **ragged)
        write_ragged(td, ("tokens", "response"), draw.response_ids, draw.response_mask, pad_value=self.pad_id, **ragged)
        if self.return_log_probs:
            write_ragged(td, (self.log_probs_key, "full"), draw.log_probs, draw.mask, **ragged)
            write_ragged(td, (self.log_probs_key, "response"), draw.response_log_probs, draw.response_mask, **ragged)
        td.set("response_truncated", ~draw.finished)
        self._write_texts(td, prompt, draw.response_ids, draw.response_mask)

    def _decode(self, ids: Tensor, mask: Tensor, *, skip_special_tokens: bool) -> list[str]:
        return self.tokenizer.batch_decode([r[m].tolist() for r, m in zip(ids, mask)],
                                           skip_special_tokens=skip_special_tokens)

    def _write_texts(self, td: TensorDictBase, prompt: EncodedBatch, resp_ids: Tensor, resp_mask: Tensor) -> None:
        tok = self.tokenizer
        if tok is None:
            return
        prompt_text = self._decode(prompt.ids, prompt.mask, skip_special_tokens=False)
        answer = self._decode(resp_ids, resp_mask, skip_special_tokens=True)
        full_text = [p + r for p, r in zip(prompt_text, self._decode(resp_ids, resp_mask, skip_special_tokens=False))]
        write_objects(td, ("text", "prompt"), prompt_text)
        write_objects(td, ("text", "response"), answer)
        write_objects(td, ("text", "full"), full_text)
        if self.input_mode == "history":
            chats = read_chats(td, ("history", "prompt"))
            write_objects(td, ("history", "full"),
                          [c + [{"role": "assistant", "content": a}] for c, a in zip(chats, answer)])

    # ---------------------------------------------------------------- scoring
    def _score(self, td: TensorDictBase) -> None:
        enc = self._encode(td, "full", "right")
        if self.input_mode != "tokens":
            refuse_retokenising(td, enc.ids, enc.mask, self.input_mode)
        stats = self.score(enc.ids, enc.mask)
        out_device = td.device if td.device is not None else enc.ids.device
        assistant = enc.assistant_mask
        if assistant is None and enc.prompt_lengths is not None:
            position = position_ids(enc.mask)
            assistant = enc.mask & (position >= enc.prompt_lengths.to(enc.mask.device)[:, None])
        self._write_common(td, enc.ids, enc.mask, assistant)
        if not self.return_log_probs:
            return
        lp = stats.log_probs.to(out_device)
        if not torch.is_grad_enabled():
            lp = lp.detach()
        ragged = dict(pad_output=self.pad_output, padding_side=self.padding_side)
        write_ragged(td, (self.log_probs_key, "full"), lp, enc.mask, **ragged)
        if enc.prompt_lengths is not None:
            write_ragged(td, (self.log_probs_key, "response"), lp, assistant, **ragged)
            write_ragged(td, ("tokens", "response"), enc.ids, assistant, pad_value=self.pad_id, **ragged)

    def _write_common(self, td: TensorDictBase, ids: Tensor, mask: Tensor, assistant: Tensor | None) -> None:
        ragged = dict(pad_output=self.pad_output, padding_side=self.padding_side)
        write_ragged(td, ("tokens", "full"), ids, mask, mask_key=("masks", "all_attention_mask"),
                     pad_value=self.pad_id, **ragged)
        if assistant is not None:
            write_ragged(td, ("masks", "all_assistant_mask"), assistant & mask, mask, **ragged)

