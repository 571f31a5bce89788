"""The KL the leash is measured by: the sampled k1 estimate and the exact full-vocabulary KL.

Both are per answer (summed over its response tokens) and describe the policy that sampled
the batch, before the step's update:

* sampled: ``sum_t log pi(y_t) - log pi_ref(y_t)`` over the sampled tokens (k1). Unbiased
  for the sequence KL, but each token adds the noise of its own draw, and a batch mean
  can even be negative.
* exact: ``sum_t KL(pi(.|y_<t) || pi_ref(.|y_<t))`` over the full vocabulary at each
  position of the sampled answers (``tether.models.scoring.exact_kl_tokens``, from hidden
  states in chunks, never ``[B, T, V]``). Its expectation over answers is the same
  sequence KL; it drops the per-token sampling noise (a Rao-Blackwellised estimate) and
  is never negative.

The controller is fed the exact KL (a cleaner signal for its derivative term), and the
``kl_bound`` check uses it too. Models whose head is not a linear map of the last hidden
state (soft-capped logits) have no exact KL; the sampled one is then used and the record's
``kl_signal`` says so. The exact KL costs one no-grad forward of the policy and of the
reference over the batch plus two chunked head projections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tether.models.scoring import causal_lm_parts, exact_kl_tokens


@dataclass(frozen=True)
class KLMeasurement:
    """Per-answer KLs of one batch (``[B]`` each, float64) and its response token count."""

    sampled: Tensor
    exact: Tensor | None
    tokens: int

    @property
    def signal(self) -> Tensor:
        """What the controller and the bound see: the exact KL when there is one."""
        return self.exact if self.exact is not None else self.sampled

    def metrics(self, kl_bound: float) -> dict[str, Any]:
        """Record entries: both KLs per answer (``*_per_seq``) and per token, and the bound check."""
        per_token = max(self.tokens, 1)
        out: dict[str, Any] = {
            "kl_per_seq": float(self.sampled.mean()),
            "kl_per_token": float(self.sampled.sum()) / per_token,
        }
        if self.exact is not None:
            out["kl_exact_per_seq"] = float(self.exact.mean())
            out["kl_exact_per_token"] = float(self.exact.sum()) / per_token
        measured = float(self.signal.mean())
        out["kl_signal"] = "exact" if self.exact is not None else "sampled"
        out["kl_over_bound"] = measured > kl_bound
        return out


def has_exact_kl(policy: torch.nn.Module) -> bool:
    """Whether the policy's logits are a linear head of its hidden states (exact KL possible)."""
    return causal_lm_parts(policy).decoder is not None


def measure_kl(batch: Any, sampled: Tensor, *, policy: torch.nn.Module | None, reference: torch.nn.Module,
               temperature: float) -> KLMeasurement:
    """Both KLs of a sampled batch; ``policy=None`` skips the exact one.

    Args:
        batch: the rollout TensorDict (``("tokens", "full")``, ``("masks", ...)``).
        sampled: ``[B]`` summed ``log pi - log pi_ref`` of each answer's sampled tokens.
        policy, reference: the two models, scored at the sampling ``temperature``.
    """
    mask = batch["masks", "all_assistant_mask"]
    exact = None
    if policy is not None:
        per_token = exact_kl_tokens(policy, reference, batch["tokens", "full"],
                                    batch["masks", "all_attention_mask"], temperature=temperature, where=mask)
        exact = (per_token.to(mask.device) * mask).sum(-1).double().cpu()
    return KLMeasurement(sampled=sampled.detach().double().cpu(), exact=exact, tokens=int(mask.sum()))
