"""Ancestral sampling from a causal LM with exact per-token log-probs.

tether samples with its own decode loop over the model's KV cache instead of ``model.generate``:
each sampled token's log-prob is read from the very distribution it was drawn from,
``softmax(logits / temperature)`` in float32, so sampling and training log-probs agree to
float precision. Top-k / top-p truncate what is sampled, not what is recorded. A token is drawn
by inverting its row's cumulative distribution at one uniform (``draw_categorical``): the law of
``torch.multinomial`` without its exponential per vocabulary entry. Finished rows
leave the batch and its cache at once; a prompt repeated ``G`` times is prefilled once. The
only host syncs are the finished-row checks. On a GPU the step runs over static buffers as a
replayed CUDA graph (``tether.models.static_decode``). ``past`` continues rows from an earlier call's
``keep_cache=True`` (``RowCache``), prefilling only their new tokens (a multi-turn rollout's
turns). ``draw`` lets several processes sample one batch together (``tether.train.sharding``).
Rationale in the docs (``docs/design.md``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from tether._compat import cache_layers, new_cache, select_cache_rows
from tether.models.score_plan import check_fits_model, distinct_rows
from tether.models.static_decode import StaticDecoder, static_decode_supported
from tether.ops.checks import check_mask, check_temperature, check_token_ids, real_number, whole_number
from tether.ops.logprobs import draw_categorical
from tether.ops.masks import pad_rows, position_ids


@dataclass(frozen=True)
class RowCache:
    """What the model has read of one row: per layer, keys and values ``[heads, length, head_dim]``
    of the row's tokens so far (its context and every sampled token but the last)."""

    layers: tuple[tuple[Tensor, Tensor], ...]

    @property
    def length(self) -> int:
        return int(self.layers[0][0].shape[1])


@dataclass(frozen=True)
class SampleOutput:
    """Responses sampled for a batch of prompts (right-padded).

    Attributes:
        tokens: ``long [B, R]`` sampled ids; ``pad_id`` after a row's end.
        mask: ``bool [B, R]``, True on every sampled token including the eos that ended it.
        log_probs: ``float32 [B, R]``, log-prob of each sampled token, 0 where masked.
        finished: ``bool [B]``, True where the row ended with an eos token (not truncated).
        caches: with ``keep_cache=True``, each row's ``RowCache`` (None for a model whose cache
            is not a plain full-attention one), to continue the row in a later call.
    """

    tokens: Tensor
    mask: Tensor
    log_probs: Tensor
    finished: Tensor
    caches: tuple[RowCache | None, ...] | None = None


class RowDraw(Protocol):
    """How a decode step turns probabilities into tokens and decides that sampling is over."""

    def tokens(self, probs: Tensor, generator: torch.Generator | None) -> Tensor:
        """One token id per row of ``probs [b, V]`` (``long [b]``)."""

    def all_ended(self, ended: Tensor) -> bool:
        """Whether sampling is over, given which of this process's live rows just ended (``bool [b]``)."""


class LocalDraw:
    """The one-process draw: ``draw_categorical`` over the rows, over when every row has ended."""

    def tokens(self, probs: Tensor, generator: torch.Generator | None) -> Tensor:
        return draw_categorical(probs, generator)

    def all_ended(self, ended: Tensor) -> bool:
        return bool(ended.all())


def check_sampling_options(
    *, temperature: object, max_new_tokens: object, top_k: object = None, top_p: object = None
) -> None:
    """Refuse sampling options that would fail deep inside torch or change the distribution.

    ``temperature`` must be a finite number > 0 (``inf`` would sample uniformly while the
    log-probs claim otherwise), ``max_new_tokens`` an int >= 1, ``top_k`` None or an int
    >= 0 (0 keeps every token, as in Hugging Face), ``top_p`` None or a number in
    ``(0, 1]`` (0 would keep no token at all).
    """
    check_temperature(temperature)
    whole_number("max_new_tokens", max_new_tokens, low=1, fix="It is the response length limit.")
    if top_k is not None:
        whole_number("top_k", top_k, low=0, fix="Use None to keep every token.")
    if top_p is not None:
        real_number("top_p", top_p, low=0, low_open=True, high=1,
                    fix="It is the nucleus mass kept; use None or 1.0 to keep every token.")


def check_prompts(prompt_ids: object, prompt_mask: object) -> Tensor:
    """Refuse prompts the decode loop would answer from padding; return the mask as bool.

    The first sampled token is read off the logits at the last column, so every row must
    end on a real token: a row with no valid token (an empty prompt) or a right-padded row
    would be continued from a pad token instead of from its prompt.
    """
    check_token_ids("prompt_ids", prompt_ids)
    mask = check_mask("prompt_mask", prompt_mask)
    if prompt_ids.dim() != 2 or mask.shape != prompt_ids.shape:
        raise ValueError(
            f"prompt_ids/prompt_mask: expected two [B, P] tensors of the same shape, got "
            f"{tuple(prompt_ids.shape)} and {tuple(mask.shape)}."
        )
    if prompt_ids.shape[0] == 0 or (mask.shape[1] > 0 and bool(mask[:, -1].all())):
        return mask
    empty = (~mask.any(-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"prompt_mask: rows {empty[:8]} (of {prompt_ids.shape[0]}) have no prompt token; a "
            "response would be sampled from padding alone. Drop empty prompts from the batch "
            "or give each at least one token (e.g. the chat template's generation prompt)."
        )
    ragged = (~mask[:, -1]).nonzero().flatten().tolist()
    raise ValueError(
        f"prompt_mask: rows {ragged[:8]} end on padding; sampling expects left-padded prompts "
        "(every row's last column a real token). Move the padding to the left."
    )


def _filter_logits(logits: Tensor, top_k: int | None, top_p: float | None) -> Tensor:
    """Set to -inf the logits outside the top-k / nucleus set (``[B, V]``)."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token if the mass strictly before it is below top_p (the top token always).
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _check_row_limits(row_limits: Tensor | None, batch: int, max_new_tokens: int, device) -> Tensor:
    """``row_limits`` checked (``long [B]`` in ``[1, max_new_tokens]``), or all ``max_new_tokens``."""
    if row_limits is None:
        return torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
    if not isinstance(row_limits, Tensor) or row_limits.is_floating_point() or row_limits.dtype == torch.bool:
        raise TypeError(f"row_limits: expected an integer tensor [B] or None, got {row_limits!r}.")
    if tuple(row_limits.shape) != (batch,):
        raise ValueError(f"row_limits: expected shape [B] = [{batch}], got {tuple(row_limits.shape)}.")
    if batch and (int(row_limits.min()) < 1 or int(row_limits.max()) > max_new_tokens):
        raise ValueError(
            f"row_limits: expected values in [1, max_new_tokens={max_new_tokens}], got "
            f"{row_limits.tolist()}; end a row with no budget left before sampling."
        )
    return row_limits.to(device=device, dtype=torch.long)


def _distinct_prompts(prompt_ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """GRPO repeats each prompt G times, so each distinct prompt is read once: ``(first [U],
    inverse [B])`` as ``distinct_rows``, ``inverse`` None where every row is distinct."""
    first, inverse = distinct_rows(prompt_ids.masked_fill(~mask.bool(), -1))
    return (first, inverse) if first.shape[0] < prompt_ids.shape[0] else (first, None)


def _prefill(model: nn.Module, prompt_ids: Tensor, mask: Tensor,
             past: Sequence[RowCache | None] | None = None) -> tuple[Tensor, object, Tensor, Tensor]:
    """Run the prompts once: last-position logits ``[B, 1, V]``, the KV cache, next positions
    ``[B, 1]`` and the attention mask over the cache's columns ``[B, S]``; the cache rows of a
    repeated prompt are copies of its one read."""
    if past is not None and any(p is not None for p in past):
        return _prefill_after(model, prompt_ids, mask, past)
    position = position_ids(mask)
    first, inverse = _distinct_prompts(prompt_ids, mask)
    rows = slice(None) if inverse is None else first
    cache = new_cache()
    logits = model(input_ids=prompt_ids[rows], attention_mask=mask[rows], position_ids=position[rows],
                   past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    if inverse is not None:
        logits = logits[inverse]
        select_cache_rows(cache, inverse)
    return logits, cache, position[:, -1:] + 1, mask


def _prefill_after(model: nn.Module, new_ids: Tensor, mask: Tensor,
                   past: Sequence[RowCache | None]) -> tuple[Tensor, object, Tensor, Tensor]:
    """``_prefill`` of each row's new tokens after its cached ones. Columns: the caches
    left-padded to the longest, then the new tokens left-padded; the mask skips both paddings
    and the positions count each row's real tokens."""
    known = next(p for p in past if p is not None)
    lengths = torch.tensor([0 if p is None else p.length for p in past], device=mask.device)
    width = int(lengths.max())
    layers = []
    for layer, (k0, v0) in enumerate(known.layers):
        def padded(which: int, like: Tensor) -> Tensor:  # rows [H, n, D] -> [B, H, width, D], left-padded
            rows = [like.new_zeros(0, like.shape[0], like.shape[2]) if p is None else
                    p.layers[layer][which].transpose(0, 1) for p in past]
            return pad_rows(rows, padding_side="left").values.transpose(1, 2).contiguous()
        layers.append((padded(0, k0), padded(1, v0)))
    held = torch.arange(width, device=mask.device) >= width - lengths[:, None]
    full = torch.cat([held.long(), mask], dim=-1)
    position = lengths[:, None] + position_ids(mask)
    cache = new_cache(layers)
    logits = model(input_ids=new_ids, attention_mask=full, position_ids=position, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits
    return logits, cache, position[:, -1:] + 1, full


def _use_static(model: nn.Module, static_cache: bool | None, device: torch.device,
                past: Sequence[RowCache | None] | None, keep_cache: bool) -> bool:
    """Whether ``sample_responses`` decodes with ``StaticDecoder``; refuses an explicit True it cannot honour."""
    if static_cache is False or (static_cache is None and device.type != "cuda"):
        return False
    why = ("it continues cached rows (past=)" if past is not None and any(p is not None for p in past) else
           "it returns row caches (keep_cache=True)" if keep_cache else
           None if static_decode_supported(model) else
           "the model's attention is not one static_decode implements (sliding window, soft-capping, "
           "no attention interface, or FSDP-sharded weights)")
    if why is not None and static_cache:
        raise ValueError(f"static_cache=True: this call cannot decode over static buffers: {why}. "
                         "Pass static_cache=None to pick the loop that applies.")
    return why is None


def _keep_rows(cache: object, mask: Tensor, alive: Tensor, rows: Tensor, kept: list) -> None:
    """Each of ``rows``'s cache (live-batch indices) into ``kept`` at its original row (``alive``)."""
    layers = cache_layers(cache)
    if layers is None:  # sliding-window or other caches: the next call prefills the row again
        return
    for j in rows.tolist():
        valid = mask[j].bool()
        kept[int(alive[j])] = RowCache(tuple((k[j][:, valid], v[j][:, valid]) for k, v in layers))


def _draw(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None, do_sample: bool,
          generator: torch.Generator | None, draw: RowDraw) -> tuple[Tensor, Tensor]:
    """One token per row from ``logits [b, V]`` and its log-prob under ``softmax(logits / T)``
    (the untruncated tempered distribution, also when top-k/top-p truncates the draw)."""
    scaled = logits.float() / temperature
    if do_sample:
        probs = torch.softmax(_filter_logits(scaled, top_k, top_p), dim=-1)
        token = draw.tokens(probs, generator)
    else:
        token = scaled.argmax(-1)
    return token, torch.log_softmax(scaled, dim=-1).gather(-1, token[:, None]).squeeze(-1)


@torch.no_grad()
def sample_responses(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    max_new_tokens: int,
    eos_ids: Collection[int],
    pad_id: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    do_sample: bool = True,
    generator: torch.Generator | None = None,
    row_limits: Tensor | None = None,
    draw: RowDraw | None = None,
    past: Sequence[RowCache | None] | None = None,
    keep_cache: bool = False,
    static_cache: bool | None = None,
) -> SampleOutput:
    """Sample up to ``max_new_tokens`` tokens after each left-padded prompt.

    Args:
        model: HF causal LM accepting ``past_key_values`` and ``position_ids``.
        prompt_ids: ``long [B, P]`` prompts, **left**-padded.
        prompt_mask: ``bool [B, P]`` valid prompt tokens.
        max_new_tokens: the response length limit.
        eos_ids: ids that end a response (the eos itself is kept and scored).
        pad_id: id written after a row's end.
        temperature: the sampling distribution is ``softmax(logits / temperature)``.
        top_k, top_p: optional truncation of the sampled distribution.
        do_sample: False for greedy decoding (log-probs still under the tempered softmax).
        generator: torch RNG for reproducible sampling.
        row_limits: optional ``long [B]`` per-row response limits in ``[1, max_new_tokens]``
            (a multi-turn episode's remaining token budget); a row leaves the batch once it
            reaches its limit, like a row that sampled an eos, but is not ``finished``.
        draw: how tokens are drawn and when sampling ends (None: ``LocalDraw``); a shared
            draw may leave this process with no live row while others still sample.
        past: optional ``RowCache`` per row (None: the row starts here): ``prompt_ids`` then
            holds only each row's tokens after its cached ones.
        keep_cache: return each row's ``RowCache`` in ``SampleOutput.caches``.
        static_cache: decode over fixed-size buffers, on a GPU as a replayed CUDA graph
            (``tether.models.static_decode``); None: on CUDA wherever the model and the call allow.
    """
    check_sampling_options(temperature=temperature, max_new_tokens=max_new_tokens, top_k=top_k, top_p=top_p)
    prompt_mask = check_prompts(prompt_ids, prompt_mask)
    batch, device = prompt_ids.shape[0], prompt_ids.device
    if past is not None and len(past) != batch:
        raise ValueError(f"past: expected one RowCache or None per row ({batch}), got {len(past)}.")
    cached = max((p.length for p in past or () if p is not None), default=0)
    check_fits_model(model, prompt_ids, prompt_mask, new_tokens=max_new_tokens + cached, role="prompt_ids")
    limits = _check_row_limits(row_limits, batch, max_new_tokens, device)
    draw = LocalDraw() if draw is None else draw
    pick = functools.partial(_draw, temperature=temperature, top_k=top_k, top_p=top_p, do_sample=do_sample,
                             generator=generator, draw=draw)
    forward, logits = _start(model, prompt_ids, prompt_mask, max_new_tokens, past, keep_cache, static_cache)
    kept: list | None = [None] * batch if keep_cache else None
    out = _decode(forward, logits[:, -1], limits, torch.tensor(sorted(eos_ids), device=device), pad_id,
                  max_new_tokens, pick, draw, kept)
    return out if kept is None else dataclasses.replace(out, caches=tuple(kept))


def _start(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int,
           past: Sequence[RowCache | None] | None, keep_cache: bool,
           static_cache: bool | None) -> tuple[_CacheStep | StaticDecoder, Tensor]:
    """The decode step ``sample_responses`` runs (see ``_use_static``), its prompts read: the step and
    the prefill's logits ``[B, 1, V]``."""
    if _use_static(model, static_cache, prompt_ids.device, past, keep_cache):
        decoder = StaticDecoder(model, prompt_ids.shape[0], prompt_ids.shape[1] + max_new_tokens)
        return decoder, decoder.prefill(prompt_ids, prompt_mask, *_distinct_prompts(prompt_ids, prompt_mask))
    return _CacheStep.prefilled(model, prompt_ids, prompt_mask, past)


class _CacheStep:
    """The decode step over a transformers cache: rows leave the batch and the cache with their
    sequences (the loop for CPUs, multi-turn caches and models ``StaticDecoder`` cannot run)."""

    def __init__(self, model: nn.Module, cache: object, next_pos: Tensor, mask: Tensor) -> None:
        self.model, self.cache, self.next_pos, self.mask = model, cache, next_pos, mask

    @classmethod
    def prefilled(cls, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                  past: Sequence[RowCache | None] | None) -> tuple[_CacheStep, Tensor]:
        """The step after ``_prefill`` of the prompts, and the prefill's logits ``[B, 1, V]``."""
        logits, cache, next_pos, mask = _prefill(model, prompt_ids, prompt_mask.long(), past)
        return cls(model, cache, next_pos, mask), logits

    def leave(self, keep: Tensor) -> None:
        select_cache_rows(self.cache, keep)
        self.mask, self.next_pos = self.mask[keep], self.next_pos[keep]

    def __call__(self, token: Tensor) -> Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=-1)
        logits = self.model(input_ids=token[:, None], attention_mask=self.mask, position_ids=self.next_pos,
                            past_key_values=self.cache, use_cache=True).logits
        self.next_pos = self.next_pos + 1
        return logits[:, -1]


def _decode(forward: _CacheStep | StaticDecoder, logits: Tensor, limits: Tensor, eos: Tensor, pad_id: int,
            max_new_tokens: int, pick: Callable[[Tensor], tuple[Tensor, Tensor]], draw: RowDraw,
            kept: list | None = None) -> SampleOutput:
    """The decode loop after the prefill's ``logits [B, V]``: one token per live row per step; a row
    leaves the live set at an eos or its limit, its cache first copied into ``kept`` when given
    (a ``_CacheStep``'s only)."""
    batch, device = limits.shape[0], limits.device
    alive = torch.arange(batch, device=device)  # original row of each live batch entry
    tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    log_probs = torch.zeros(batch, max_new_tokens, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        token, token_log_prob = pick(logits)
        tokens[alive, step] = token
        log_probs[alive, step] = token_log_prob
        lengths.index_fill_(0, alive, step + 1)  # index assignment of a Python number copies it to the GPU: a sync
        ended = torch.isin(token, eos)
        finished[alive] = finished[alive] | ended  # no boolean-mask index: no host sync on CUDA
        ended = ended | (limits[alive] <= step + 1)
        if step + 1 == max_new_tokens or draw.all_ended(ended):
            if kept is not None:
                _keep_rows(forward.cache, forward.mask, alive, torch.arange(alive.numel()), kept)
            break
        if bool(ended.any()):
            if kept is not None:
                _keep_rows(forward.cache, forward.mask, alive, ended.nonzero().flatten(), kept)
            keep = (~ended).nonzero().flatten()
            forward.leave(keep)
            alive, token = alive[keep], token[keep]
        if not alive.numel():  # only under a shared draw: other processes' rows are still sampling
            logits = logits[:0]
            continue
        logits = forward(token)
    width = int(lengths.max()) if batch else 0
    resp_mask = torch.arange(width, device=device) < lengths[:, None]
    return SampleOutput(
        tokens=tokens[:, :width].masked_fill(~resp_mask, pad_id),
        mask=resp_mask,
        log_probs=log_probs[:, :width].masked_fill(~resp_mask, 0.0),
        finished=finished,
    )
