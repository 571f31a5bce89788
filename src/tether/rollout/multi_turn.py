"""``MultiTurnRollout``: a batch of conversations advances turn by turn, calling tools as it goes.

Each turn samples one assistant message for every running conversation with the wrapper's own
sampler; tool calls in it are run and their results appended as tool turns. An episode ends at
``"answer"`` (no tool call), ``"max_turns"``, ``"token_budget"`` (``max_tokens`` reached) or
``"length"`` (``max_new_tokens`` without an end-of-turn). Finished conversations leave the
batch.

Token-first: each conversation is kept as token ids, never re-tokenised, so the log-probs
recorded at sampling are those of the very ids the trainer scores and the assistant mask is
True on exactly the sampled tokens (with their end-of-turn token). Each row's KV cache is kept
from one turn to the next (``kv_cache=True``), so a turn prefills only its new tokens. How the
ids are stitched together: ``docs/design.md``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import Tensor

from tether.models import TransformersWrapper
from tether.models.batch_io import read_chats, write_objects, write_ragged
from tether.models.chat import render_chat_ids
from tether.models.sampling import RowCache, sample_responses
from tether.ops.checks import whole_number
from tether.ops.masks import Padded, pad_rows
from tether.rollout.tool_calls import ParsedCall, resolve_tool_format
from tether.rollout.tools import Tool, ToolResult, resolve_tools, run_tool_call

__all__ = ["END_REASONS", "MultiTurnRollout", "episode_metrics"]

END_REASONS = ("answer", "max_turns", "token_budget", "length")


@dataclass
class _Episode:
    """One conversation as it grows: token ids with their mask and log-probs, and its counters."""

    chat: list[dict[str, str]]
    ids: list[int]
    assistant: list[bool] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    errors: Counter = field(default_factory=Counter)
    end: str | None = None
    answer: str = ""

    def extend(self, ids: list[int], log_probs: list[float] | None) -> None:
        self.ids += ids
        self.assistant += [log_probs is not None] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)


class MultiTurnRollout(TensorDictModuleBase):
    """Sample whole conversations, with tool calls, for a batch of chat prompts.

    Args:
        policy: a generating ``TransformersWrapper`` in ``"history"`` mode; its sampler,
            temperature, ``generate_kwargs`` (``max_new_tokens`` is the per-message limit),
            eos / pad ids, ``log_probs_key`` and layout options are used as they are.
        tools: tool names from ``tether.rollout.TOOLS`` and/or ``Tool`` objects.

    Keyword Args:
        max_turns: most assistant messages per conversation.
        max_tokens: most tokens a conversation may hold; None for no budget.
        tool_format: a name from ``TOOL_CALL_FORMATS`` or a parser ``text -> [ParsedCall]``.
        tool_role: the role of tool-result messages in the chat.
        tokenizer_kwargs: extra ``apply_chat_template`` arguments (template variables).
        kv_cache: keep each row's KV cache across turns (False: prefill the whole
            conversation every turn).

    Reads ``("history", "prompt")``. Writes ``("tokens", "full")``,
    ``("masks", "all_attention_mask")``, ``("masks", "all_assistant_mask")``,
    ``(log_probs_key, "full")`` (0 outside the assistant mask), ``("history", "full")``,
    ``("text", "response")`` (the last assistant message), ``"response_truncated"``
    (ended by ``"length"`` or ``"token_budget"``) and ``("episode", "turns" | "tool_calls" |
    "tool_errors")`` (``long [B]``) and ``("episode", "end")`` (one of ``END_REASONS`` per row).
    """

    def __init__(
        self,
        policy: TransformersWrapper,
        tools: Iterable[str | Tool] | Mapping[str, Tool] = ("calculator",),
        *,
        max_turns: int = 4,
        max_tokens: int | None = None,
        tool_format: str | Callable[[str], list[ParsedCall]] = "hermes",
        tool_role: str = "tool",
        tokenizer_kwargs: Mapping[str, Any] | None = None,
        kv_cache: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(policy, TransformersWrapper) or not policy.generate or policy.input_mode != "history":
            raise TypeError(
                "policy: expected a TransformersWrapper(model, tokenizer, input_mode='history', "
                f"generate=True), got {type(policy).__name__}"
                + (f" with input_mode={policy.input_mode!r}, generate={policy.generate}"
                   if isinstance(policy, TransformersWrapper) else "") + "."
            )
        if not isinstance(tool_role, str) or not tool_role:
            raise ValueError(f"tool_role: expected a non-empty role name such as 'tool', got {tool_role!r}.")
        self.policy = policy
        self.tools = resolve_tools(tools)
        self.parse = resolve_tool_format(tool_format)
        self.max_turns = whole_number("max_turns", max_turns, low=1)
        self.max_tokens = None if max_tokens is None else whole_number("max_tokens", max_tokens, low=1)
        self.tool_role = tool_role
        self.tokenizer_kwargs = dict(tokenizer_kwargs or {})
        self.kv_cache = bool(kv_cache)
        self._caches: dict[tuple[int, ...], RowCache] | None = None  # during forward: conversation so far -> its cache
        self.in_keys = [("history", "prompt")]
        key = policy.log_probs_key
        self.out_keys = [("tokens", "full"), ("masks", "all_attention_mask"), ("masks", "all_assistant_mask"),
                         (key, "full"), ("history", "full"), ("text", "response"), "response_truncated",
                         ("episode", "turns"), ("episode", "tool_calls"), ("episode", "tool_errors"),
                         ("episode", "end")]

    # ---------------------------------------------------------------- episode loop
    def forward(self, td: TensorDictBase) -> TensorDictBase:
        episodes = [self._start(i, chat) for i, chat in enumerate(read_chats(td, ("history", "prompt")))]
        self._caches = {} if self.kv_cache else None
        try:
            for _ in range(self.max_turns):
                running = [e for e in episodes if e.end is None]
                if not running:
                    break
                self._turn(running)
        finally:
            self._caches = None
        self._write(td, episodes)
        return td

    def _render(self, chat: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        return render_chat_ids(self.policy.tokenizer, chat, add_generation_prompt=add_generation_prompt,
                               tokenizer_kwargs=self.tokenizer_kwargs)

    def _start(self, index: int, chat: list[dict[str, str]]) -> _Episode:
        ids = self._render(chat, True)
        if self.max_tokens is not None and len(ids) >= self.max_tokens:
            raise ValueError(
                f"max_tokens={self.max_tokens} leaves no room to answer prompt {index}, which renders to "
                f"{len(ids)} tokens; raise max_tokens or shorten the prompt."
            )
        episode = _Episode(chat=[dict(m) for m in chat], ids=[])
        episode.extend(ids, None)
        return episode

    def _limit(self, episode: _Episode) -> int:
        per_message = self.policy.generate_kwargs["max_new_tokens"]
        if self.max_tokens is None:
            return per_message
        return min(per_message, self.max_tokens - len(episode.ids))

    def sample_turn(self, rows: list[list[int]], limits: list[int]) -> list[tuple[list[int], list[float], bool]]:
        """One assistant message per row: ``(sampled ids, their log-probs, ended by an eos)``."""
        wrapper, opts = self.policy, self.policy.generate_kwargs
        past = self._cached(rows)
        new = [r if p is None else r[p.length:] for r, p in zip(rows, past)]
        prompts = pad_rows([torch.tensor(r, dtype=torch.long) for r in new], padding_value=wrapper.pad_id,
                           padding_side="left")
        sample = sample_responses(
            wrapper.model, prompts.values.to(wrapper.device), prompts.mask.to(wrapper.device),
            max_new_tokens=max(limits), eos_ids=wrapper.eos_ids, pad_id=wrapper.pad_id,
            temperature=wrapper.temperature, top_k=opts.get("top_k"), top_p=opts.get("top_p"),
            do_sample=bool(opts.get("do_sample", True)), generator=opts.get("generator"),
            row_limits=torch.tensor(limits), past=past if any(past) else None, keep_cache=self._caches is not None,
        )
        out = []
        for i, (tokens, valid, log_probs, finished) in enumerate(zip(sample.tokens.cpu(), sample.mask.cpu(),
                                                                     sample.log_probs.cpu(), sample.finished.cpu())):
            out.append((tokens[valid].tolist(), log_probs[valid].tolist(), bool(finished)))
            if sample.caches is not None and sample.caches[i] is not None:
                self._caches[tuple(rows[i] + out[-1][0])] = sample.caches[i]
        return out

    def _cached(self, rows: list[list[int]]) -> list[RowCache | None]:
        """Each row's cache from its last turn (taken out of the store), or None: a row continues the
        conversation ``key`` when it starts with ``key``; the cache holds all of ``key`` but its last id."""
        if not self._caches:
            return [None] * len(rows)
        lengths = sorted({len(key) for key in self._caches}, reverse=True)
        past = []
        for row in rows:
            key = next((tuple(row[:n]) for n in lengths if n < len(row) and tuple(row[:n]) in self._caches), None)
            past.append(None if key is None else self._caches.pop(key))
        self._caches.clear()  # the rest ended with their episodes
        return past

    def _turn(self, running: list[_Episode]) -> None:
        limits = [self._limit(e) for e in running]
        sampled = self.sample_turn([e.ids for e in running], limits)
        eos = self.policy.eos_ids
        contents = self.policy.tokenizer.batch_decode(
            [ids[:-1] if finished else ids for ids, _, finished in sampled], skip_special_tokens=True)
        for episode, (ids, log_probs, finished), text, limit in zip(running, sampled, contents, limits):
            episode.extend(ids, log_probs)
            episode.chat.append({"role": "assistant", "content": text})
            episode.turns += 1
            episode.answer = text
            if not finished or ids[-1] not in eos:
                at_budget = limit < self.policy.generate_kwargs["max_new_tokens"]
                episode.end = "token_budget" if at_budget else "length"
                continue
            calls = self.parse(text)
            if not calls:
                episode.end = "answer"
            elif episode.turns >= self.max_turns:
                episode.end = "max_turns"
            else:
                self._run_tools(episode, calls)

    def _run_tools(self, episode: _Episode, calls: list[ParsedCall]) -> None:
        results: list[ToolResult] = [run_tool_call(self.tools, call) for call in calls]
        episode.tool_calls += len(results)
        episode.errors.update(r.error for r in results if r.error is not None)
        messages = [{"role": self.tool_role, "content": r.content} for r in results]
        episode.extend(self._glue(episode.chat, messages), None)
        episode.chat += messages
        if self.max_tokens is not None and len(episode.ids) >= self.max_tokens:
            episode.end = "token_budget"

    def _glue(self, chat: list[dict[str, str]], messages: list[dict[str, str]]) -> list[int]:
        """Template ids after the last assistant turn's end-of-turn token: tool turns and the next prompt."""
        before = self._render(chat, False)
        after = self._render(chat + messages, True)
        if after[: len(before)] != before:
            raise ValueError(
                "the chat template renders a conversation differently once tool turns follow it, so tool "
                "results cannot be appended token by token; use a template that renders earlier turns "
                "unchanged (ChatML does)."
            )
        ends = [t for t, token in enumerate(before) if token in self.policy.eos_ids]
        if not ends:
            raise ValueError(
                f"the rendered assistant turn holds no end-of-turn token (eos ids {sorted(self.policy.eos_ids)}); "
                "pass the template's end-of-turn id as eos_token_id to the TransformersWrapper."
            )
        return after[ends[-1] + 1 :]

    # ---------------------------------------------------------------- outputs
    def _write(self, td: TensorDictBase, episodes: list[_Episode]) -> None:
        device = td.device if td.device is not None else torch.device("cpu")

        def grid(rows: list[list], dtype: torch.dtype, fill) -> Padded:
            padded = pad_rows([torch.tensor(r, dtype=dtype) for r in rows], padding_value=fill)
            return Padded(padded.values.to(device), padded.mask.to(device))

        tokens = grid([e.ids for e in episodes], torch.long, self.policy.pad_id)
        assistant = grid([e.assistant for e in episodes], torch.bool, False).values
        log_probs = grid([e.log_probs for e in episodes], torch.float32, 0.0).values
        mask = tokens.mask
        layout = dict(pad_output=self.policy.pad_output, padding_side=self.policy.padding_side)
        write_ragged(td, ("tokens", "full"), tokens.values, mask, mask_key=("masks", "all_attention_mask"),
                     pad_value=self.policy.pad_id, **layout)
        write_ragged(td, ("masks", "all_assistant_mask"), assistant, mask, **layout)
        write_ragged(td, (self.policy.log_probs_key, "full"), log_probs, mask, **layout)
        write_objects(td, ("history", "full"), [e.chat for e in episodes])
        write_objects(td, ("text", "response"), [e.answer for e in episodes])
        write_objects(td, ("episode", "end"), [e.end or "max_turns" for e in episodes])
        td.set("response_truncated", torch.tensor([e.end in ("length", "token_budget") for e in episodes],
                                                  device=device))
        for name, values in (("turns", [e.turns for e in episodes]),
                             ("tool_calls", [e.tool_calls for e in episodes]),
                             ("tool_errors", [sum(e.errors.values()) for e in episodes])):
            td.set(("episode", name), torch.tensor(values, dtype=torch.long, device=device))


def episode_metrics(counters: Mapping[str, Tensor]) -> dict[str, float]:
    """Tool-use statistics of the ``[B]`` episode counters ``MultiTurnRollout`` writes under
    ``("episode", ...)`` (pass ``td["episode"]``, or ``StepRecord.episode``).

    ``tool_call_rate``: fraction of episodes that ran at least one tool call;
    ``tool_calls_per_episode``; ``tool_error_rate``: failed calls over all calls (0 with no
    calls); ``turns_per_episode``: assistant messages per episode.
    """
    turns, calls, errors = (counters[k].double() for k in ("turns", "tool_calls", "tool_errors"))
    total = float(calls.sum())
    return {
        "tool_call_rate": float((calls > 0).double().mean()),
        "tool_calls_per_episode": float(calls.mean()),
        "tool_error_rate": float(errors.sum()) / total if total else 0.0,
        "turns_per_episode": float(turns.mean()),
    }
