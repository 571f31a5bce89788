"""Decoding over fixed-size key/value buffers, one token's forward replayed as a CUDA graph.

A Hugging Face decode step launches every layer's kernels from Python, and grows its cache by
concatenation; on a GPU at GRPO's batch sizes the host launching them sets the pace (docs/gpu.md).
Here each layer's keys and values go to preallocated ``[B, Hkv, L, D]`` buffers through a registered
attention kernel (``STATIC_ATTENTION``) that writes the step's columns and attends over the whole
buffer under a boolean mask. With fixed shapes and no host sync in it, a token's forward is captured
once per ``sample_responses`` call and replayed. Rows never leave the buffers: a finished row is still
computed and its logits unread, so the draw sees exactly the live rows the dynamic loop sees. On a
CPU the same forward runs eagerly (the tests' parity with the dynamic loop). Models with sliding
windows or soft-capped attention, FSDP-sharded ones and multi-turn caches keep the dynamic loop.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tether._compat import attention_implementation, attention_kernel, register_attention, supports_attention_interface
from tether.ops.masks import position_ids

STATIC_ATTENTION = "tether_static_attention"
_UNSUPPORTED_CONFIG = ("sliding_window", "attn_logit_softcapping")


class GraphNote(UserWarning):
    """A decode step could not be captured as a CUDA graph and runs eagerly over the static buffers."""


@dataclass
class StaticKV:
    """Every layer's keys and values of ``B`` rows over ``L`` columns, and what each row may read.

    Attributes:
        keys, values: per layer ``[B, Hkv, L, D]``.
        valid: ``bool [B, L]``, the columns holding a row's real tokens so far.
        column: ``long [1]``, where the next forward's first token is written.
        prefill_mask: ``bool [B, 1, P, L]`` while the prompts are read, else None (one token
            reads ``valid``).
        rows: how many leading rows a forward covers (the distinct prompts during prefill).
    """

    keys: list[Tensor]
    values: list[Tensor]
    valid: Tensor
    column: Tensor
    prefill_mask: Tensor | None = None
    rows: int = 0


def static_decode_supported(model: nn.Module) -> bool:
    """Whether ``model``'s attention can run as ``STATIC_ATTENTION``: it goes through transformers'
    attention interface, uses no sliding window or soft-capping, and no parameter is FSDP-sharded."""
    config = getattr(model, "config", None)
    if attention_implementation(model) is None or not supports_attention_interface(model):
        return False
    if any(getattr(config, name, None) is not None for name in _UNSUPPORTED_CONFIG):
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 has no public FSDP2, so no module here is one
        return True
    return not any(isinstance(module, FSDPModule) for module in model.modules())


def static_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """Write this forward's keys/values at ``kv.column`` onward, attend over the buffers.

    ``query [b, Hq, t, D]``, ``key``/``value`` ``[b, Hkv, t, D]`` (``b = kv.rows``); returns
    ``[b, t, Hq, D]`` (transformers' attention-interface signature).
    """
    kv: StaticKV | None = kwargs.get("static_kv")
    layer = getattr(module, "layer_idx", None)
    if kv is None or layer is None:
        raise RuntimeError(
            f"{STATIC_ATTENTION}: expected static_kv= in the forward's keyword arguments and attention modules "
            "with a layer_idx; it serves tether.models.static_decode only."
        )
    rows, width = query.shape[0], query.shape[2]
    columns = kv.column + torch.arange(width, device=kv.column.device)
    keys, values = kv.keys[layer][:rows], kv.values[layer][:rows]
    keys.index_copy_(2, columns, key.to(keys.dtype))
    values.index_copy_(2, columns, value.to(values.dtype))
    mask = kv.prefill_mask if kv.prefill_mask is not None else kv.valid[:rows, None, None, :]
    # Grouped-query attention without copying the buffers: the queries sharing a key/value head
    # become that head's rows ([b, Hkv, group * t, D]); mask rows repeat per group member.
    heads, group = keys.shape[1], query.shape[1] // keys.shape[1]
    grouped = query.to(keys.dtype).reshape(rows, heads, group * width, query.shape[3])
    if group > 1 and mask.shape[2] > 1:
        mask = mask.repeat(1, 1, group, 1)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(query.shape).to(query.dtype).transpose(1, 2), None


register_attention(STATIC_ATTENTION, static_attention)


class StaticDecoder:
    """One model's decode over ``StaticKV`` for ``B`` rows, ``L`` columns (see the module doc).

    ``prefill`` reads the left-padded prompts; then each call feeds the live rows' tokens and returns
    their next logits ``[b, V]``; ``leave`` drops rows from the live set.
    """

    def __init__(self, model: nn.Module, batch: int, columns: int, *, graph: bool = True) -> None:
        config = model.config
        text = getattr(config, "get_text_config", lambda: config)()
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        weight = model.get_input_embeddings().weight  # the keys' dtype and device
        columns = -(-columns // 16) * 16  # the memory-efficient SDPA kernel wants a mask width of 16k
        shape = (batch, kv_heads, columns, head_dim)
        new = lambda: weight.new_zeros(shape)  # noqa: E731
        layers = text.num_hidden_layers
        self.model, self.graph_wanted = model, graph
        self.kv = StaticKV([new() for _ in range(layers)], [new() for _ in range(layers)],
                           torch.zeros(batch, columns, dtype=torch.bool, device=weight.device),
                           torch.zeros(1, dtype=torch.long, device=weight.device), rows=batch)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=weight.device)
        self.position = torch.zeros(batch, 1, dtype=torch.long, device=weight.device)
        self.live = torch.arange(batch, device=weight.device)
        self._captured: tuple[torch.cuda.CUDAGraph, Tensor] | bool | None = None  # None: not yet tried

    def _forward(self, ids: Tensor, position: Tensor) -> Tensor:
        with attention_kernel(self.model, STATIC_ATTENTION):
            return self.model(input_ids=ids, position_ids=position, use_cache=False, static_kv=self.kv,
                              logits_to_keep=1).logits

    def prefill(self, prompt_ids: Tensor, mask: Tensor, first: Tensor, inverse: Tensor | None) -> Tensor:
        """Read ``prompt_ids [B, P]`` (left-padded, ``mask`` bool) once per distinct row: ``first`` and
        ``inverse`` as ``distinct_rows`` gives them, or ``inverse`` None to read every row in order (then
        ``first`` is unused). The last column's logits ``[B, 1, V]``."""
        width = prompt_ids.shape[1]
        if inverse is None:  # every row distinct: read them in their own order
            first = torch.arange(prompt_ids.shape[0], device=prompt_ids.device)
        kv, rows = self.kv, first.shape[0]
        kv.valid[:, :width] = mask
        causal = torch.ones(width, width, dtype=torch.bool, device=mask.device).tril()
        reads = mask[first][:, None, None, :] & causal
        # A pad query reads itself, so no row of the softmax is empty (some kernels give NaN there).
        reads |= torch.eye(width, dtype=torch.bool, device=mask.device)
        kv.prefill_mask = F.pad(reads, (0, kv.valid.shape[1] - width))
        kv.rows = rows
        position = position_ids(mask)
        try:
            logits = self._forward(prompt_ids[first], position[first])
        finally:
            kv.prefill_mask, kv.rows = None, kv.valid.shape[0]
        if inverse is not None:
            logits = logits[inverse]
            for buffer in (*kv.keys, *kv.values):
                buffer.copy_(buffer[inverse])
        kv.column.fill_(width)
        self.position.copy_(position[:, -1:] + 1)
        return logits

    def leave(self, keep: Tensor) -> None:
        """Keep the live rows ``keep`` (indices into the live set)."""
        self.live = self.live[keep]

    def __call__(self, token: Tensor) -> Tensor:
        """Feed one token per live row (``long [b]``); their next logits ``[b, V]``."""
        self.token.index_copy_(0, self.live, token[:, None])
        self.kv.valid.index_fill_(1, self.kv.column, True)
        if self._captured is None:
            self._captured = self._capture()
        if self._captured is False:
            logits = self._forward(self.token, self.position)
        else:
            graph, logits = self._captured
            graph.replay()
        self.kv.column += 1
        self.position += 1
        return logits[self.live, -1]

    def _capture(self) -> tuple[torch.cuda.CUDAGraph, Tensor] | bool:
        """The step captured as a CUDA graph with its logits buffer, or False for the eager forward (on a
        CPU, or where capture fails). Nothing here refers back to the decoder, so it is freed on return."""
        if not (self.graph_wanted and self.token.is_cuda):
            return False
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up writes this column, which the first replay rewrites
                self._forward(self.token, self.position)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._forward(self.token, self.position)
        except Exception as error:  # noqa: BLE001 - e.g. an op in the model's forward that syncs with the host
            warnings.warn(GraphNote(f"the decode step was not captured as a CUDA graph ({type(error).__name__}: "
                                    f"{error}); it runs eagerly over the static buffers."), stacklevel=3)
            return False
        return graph, logits

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The captured step, once the first token was fed on a GPU (None: eager)."""
        return self._captured[0] if isinstance(self._captured, tuple) else None
