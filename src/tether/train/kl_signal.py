"""The KL the leash is measured by: the sampled k1 estimate and the exact full-vocabulary KL.

Both are per answer (summed over its response tokens):

* sampled: ``sum_t log pi_sampler(y_t) - log pi_ref(y_t)`` over the sampled tokens (k1).
  Unbiased for the sequence KL, but each token adds the noise of its own draw, and a
  batch mean can even be negative.
* exact: ``sum_t KL(pi(.|y_<t) || pi_ref(.|y_<t))`` over the full vocabulary at each
  position of the sampled answers. Its expectation over answers is the same sequence KL;
  it drops the per-token sampling noise (a Rao-Blackwellised estimate) and is never
  negative. It is computed inside the loss pass (``GRPOLoss.token_terms`` on a
  ``StepRecord`` carrying the reference's hidden states at the answer tokens), so it costs
  two output-head projections at the answer positions and no extra forward pass.

With ``kl_signal=exact`` (the default) the ``kl_bound`` check, the summary and the
``kl_signal`` entry of each record read the exact KL: it has the same expectation as the
sampled one with less variance, and it is never negative. The KL controller reads the
sampled KL of the batch it is about to train on instead, because that one is known before
the update: the exact KL comes out of the loss pass, when the update's beta is already in
the gradient, so a controller fed it acts one step later, and on a KL that accumulates a
step of delay costs more than the sampled KL's extra noise. On the default run the two
batch means differ by a standard deviation of 0.2 nats at 2.5 nats (36 steps of three
runs), while either moves by 0.3 to 0.7 nats a step (see ``tether.control.target``).

With one update per rollout the loss pass runs on the weights that sampled the batch, so
both KLs describe the sampling policy; with several, each mini-batch's exact KL is that of
the weights its update started from. Without an exact KL (a head that is not a linear map
of the last hidden state, or a reference scored by a Ray ``ReferenceService``, which
returns log-probs only) the sampled KL is used and the record's ``kl_signal`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tether.models.scoring import causal_lm_parts

# The config's kl_signal choices (read by TrainConfig.validate).
KL_SIGNALS: dict[str, str] = {
    "sampled": "k1 summed along the sampled answers",
    "exact": "full-vocabulary KL at every position of the sampled answers",
}


@dataclass(frozen=True)
class KLMeasurement:
    """Per-answer KLs of one batch (``[B]`` each, float64) and its response token count."""

    sampled: Tensor
    exact: Tensor | None
    tokens: int

    @property
    def signal(self) -> Tensor:
        """What the bound and the summary read: the exact KL when there is one."""
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


def measure_kl(sampled: Tensor, exact_tokens: Tensor | None, mask: Tensor) -> KLMeasurement:
    """Both KLs of a batch.

    Args:
        sampled: ``[B]`` summed ``log pi - log pi_ref`` of each answer's sampled tokens.
        exact_tokens: ``[B, T]`` exact KL per token (``GRPOTokenTerms.kl_to_ref_exact``), or None.
        mask: ``bool [B, T]`` the answer tokens.
    """
    exact = None if exact_tokens is None else (exact_tokens * mask.to(exact_tokens.device)).sum(-1).double().cpu()
    return KLMeasurement(sampled=sampled.detach().double().cpu(), exact=exact, tokens=int(mask.sum()))
