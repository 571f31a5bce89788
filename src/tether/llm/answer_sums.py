"""``answer_sums``: a per-token entry summed over each answer's tokens, one number per answer.

The KL transforms write per-token grids: ``kl_penalty`` is ``[B, T]`` and the adjusted reward
is ``r_b - coef * kl_{b,t}`` on every valid token, the per-answer reward ``r_b`` copied onto
each (prompt tokens included, as in TorchRL). Summing that reward grid counts ``r_b`` once
per token. An answer's return is ``r_b - coef * answer_sums(td, ("next", "kl_penalty"))``, and
``answer_sums(td, ("next", "kl_penalty"))`` is also the KL per answer a controller reads.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torch import Tensor

from tether.llm._token_grid import ASSISTANT_KEY, ATTENTION_KEY, as_key, find, read_grid, read_mask, scopes_of
from tether.models.batch_io import get_entry, missing_key


def answer_sums(
    td: TensorDictBase, key: NestedKey = ("next", "kl_penalty"), *, mask_key: NestedKey | None = ASSISTANT_KEY
) -> Tensor:
    """Sum of the per-token entry ``key`` over each answer's tokens: ``[B]``.

    Args:
        td: a batch ``[B]`` (padded with ``("masks", "all_attention_mask")``, jagged, or a
            lazy stack of rows). ``key`` is looked up as given, e.g. ``("next", "kl_penalty")``.
        key: a per-token entry ``[B, T]`` / ``[B, T, 1]`` or jagged; an entry holding one value
            per answer (``[B]``, ``[B, 1]``, ``[B, 1, 1]``) is returned as ``[B]`` unchanged.
        mask_key: the tokens that count (default the assistant mask); None: every valid token.

    Raises:
        KeyError: ``key`` or ``mask_key`` is absent.
        ValueError: the mask is not laid out like the entry.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"kl": torch.tensor([[9.0, 0.5, 0.25], [9.0, 9.0, 2.0]]),
        ...                  ("masks", "all_assistant_mask"): torch.tensor([[0, 1, 1], [0, 0, 1]]).bool()}, [2])
        >>> answer_sums(td, "kl").tolist()
        [0.75, 2.0]
    """
    key = as_key("key", key)
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"td: expected a TensorDict, got {type(td).__name__}.")
    scopes = (td,)
    if find(scopes, key) is None:
        raise missing_key(scopes, key, "Run the transform that writes it first (e.g. KLRewardTransform, RetrieveKL).",
                          what="a per-token entry")
    value = get_entry(td, key)
    rows = td.batch_size[0] if td.batch_dims else 1
    if not value.is_nested and value.shape[:1] == (rows,) and value.numel() == rows:
        return value.reshape(rows)
    attention = read_mask(scopes, ATTENTION_KEY, read_grid(td, key)) if not value.is_nested else None
    grid = read_grid(td, key, attention)
    values = grid.values.squeeze(-1) if grid.values.dim() == 3 and grid.values.shape[-1] == 1 else grid.values
    counted = grid.valid
    if mask_key is not None:
        mask = read_mask(scopes_of(td) + (td,), as_key("mask_key", mask_key), grid)
        if mask is None:
            raise missing_key(td, mask_key, "Pass mask_key=None to sum over every valid token.",
                              what="the mask of each answer's tokens")
        counted = counted & mask
    return torch.where(counted, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum(-1)
