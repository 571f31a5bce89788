"""Builders for GRPOLoss tests: tiny float64 scorers and batches with controlled log-ratios.

``make_batch`` scores the tokens with the actor first and then sets the sampling log-probs
to ``current - delta`` (and the reference ones to ``current - rho``), so the per-token
log-ratio of the loss is exactly the ``delta`` a test chose and hand derivations hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import Tensor, nn

from tether.models import TransformersWrapper
from tether.ops import TokenStats
from tests.helpers import make_tiny_model, make_tokenizer

F64 = torch.float64


def tiny_wrapper(seed: int = 0) -> TransformersWrapper:
    """A real ``TransformersWrapper`` (scoring mode) over a 2-layer float64 Llama."""
    tok = make_tokenizer()
    return TransformersWrapper(make_tiny_model(tok, dtype=F64, seed=seed), tok, input_mode="tokens", generate=False)


class UnigramActor(nn.Module):
    """A context-free policy ``pi(x_t | x_<t) = softmax(logits)[x_t]`` with a ``score`` method.

    Its log-probs do not depend on the prompt, so prepending prompt tokens must leave every
    value of the loss unchanged, and its gradients are easy to enumerate.
    """

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.tensor(logits, dtype=F64))

    def score(self, tokens: Tensor, attention_mask: Tensor, *, with_entropy: bool = False) -> TokenStats:
        logp_all = F.log_softmax(self.logits, -1)
        mask = attention_mask.bool()
        first = mask.int().argmax(-1, keepdim=True)
        scored = mask & (torch.arange(mask.shape[1])[None, :] != first)
        logp = torch.where(scored, logp_all[tokens], torch.zeros((), dtype=F64))
        entropy = None
        if with_entropy:
            value = -(logp_all.exp() * logp_all).sum()
            entropy = torch.where(scored, value.expand(tokens.shape), torch.zeros((), dtype=F64))
        return TokenStats(log_probs=logp, entropy=entropy)


def scored(actor, tokens: Tensor, attention: Tensor) -> TokenStats:
    with torch.no_grad():
        return actor.score(tokens, attention, with_entropy=True)


def make_batch(
    actor,
    tokens: Tensor,
    attention: Tensor,
    loss_mask: Tensor,
    advantage: Tensor,
    *,
    delta: Tensor | None = None,
    rho: Tensor | None = None,
    outside: float = 0.0,
) -> TensorDict:
    """A GRPO batch whose log-ratio is ``delta`` and whose ``current - ref`` is ``rho``.

    ``delta`` / ``rho`` are ``[B, T]`` (only their values inside ``loss_mask`` matter).
    Entries outside the mask get ``outside`` (use NaN to prove padding never leaks).
    """
    cur = scored(actor, tokens, attention).log_probs
    zeros = torch.zeros_like(cur)
    delta = zeros if delta is None else delta.to(F64)
    rho = zeros if rho is None else rho.to(F64)
    fill = torch.full_like(cur, outside)
    sample = torch.where(loss_mask, cur - delta, fill)
    ref = torch.where(loss_mask, cur - rho, fill)
    return TensorDict(
        {
            ("tokens", "full"): tokens,
            ("masks", "all_attention_mask"): attention,
            ("masks", "all_assistant_mask"): loss_mask,
            ("log_probs", "full"): sample,
            ("ref_log_probs", "full"): ref,
            "advantage": advantage.to(F64),
        },
        batch_size=[tokens.shape[0]],
    )


def place(values: list[list[float]], loss_mask: Tensor) -> Tensor:
    """Per-row lists of values written, in order, at the True positions of ``loss_mask``."""
    out = torch.zeros(loss_mask.shape, dtype=F64)
    for row, row_values in enumerate(values):
        cols = torch.nonzero(loss_mask[row]).flatten()
        if len(cols) != len(row_values):
            raise ValueError(f"row {row}: {len(row_values)} values for {len(cols)} masked positions")
        out[row, cols] = torch.tensor(row_values, dtype=F64)
    return out


def two_row_grid() -> tuple[Tensor, Tensor, Tensor]:
    """Tokens ``[2, 6]``: row 0 full length with response at cols 3-4; row 1 left-padded by
    one with response at cols 3-5. Returns (tokens, attention, loss_mask)."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 250, (2, 6), generator=gen)
    attention = torch.ones(2, 6, dtype=torch.bool)
    attention[1, 0] = False
    loss_mask = torch.zeros(2, 6, dtype=torch.bool)
    loss_mask[0, 3:5] = True
    loss_mask[1, 3:6] = True
    return tokens, attention, loss_mask
