"""``GRPOLoss``: the clipped GRPO objective with a KL leash, composed from ``tether.ops``.

Shao et al. (2024) with later refinements as options. Departures from the paper and TorchRL's
``GRPOLoss``: one ``actor_network.score`` call gives log-probs and entropy without
``[B, T, V]`` logits; the trained tokens are an explicit mask (TorchRL's ``log_prob != 0``
dropped real tokens); every term is reduced by one ``aggregate`` (TorchRL averaged the KL over
the padded grid); the KL term defaults to the importance-weighted k3, whose expected gradient is
the reverse KL's even off-policy; nothing is written into the caller's TensorDict. The training
recipe writes the same loss itself (``tether.train.recipe.token_terms``, held equal by a test).
Rationale: docs/design.md.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable

import torch
from tensordict import TensorDictBase
from torch import Tensor, nn

from tether.models.records import GRPOLossOutput, GRPOTokenTerms, HeadHidden, StepRecord, scores_positions
from tether.objectives.grpo_inputs import (AGGREGATION_ALIASES, MASKING_STRATEGIES, GRPOBatch, GRPOKeys,
                                           grpo_batch_from_record, read_grpo_batch, refuse_torchrl_only)
from tether.ops import (
    TokenStats,
    aggregate,
    effective_sample_size,
    gspo_log_ratio,
    importance_weights,
    kl_estimate,
    kl_loss_term,
)
from tether.ops.aggregate import check_aggregation
from tether.ops.checks import kl_coefficient, lookup, real_number, whole_number
from tether.ops.kl import check_kl_loss_options
from tether.ops.policy_loss import IMPORTANCE_WEIGHT_MODES, check_dual_clip, clip_bounds
from tether.ops.trust_region import check_trust_region, trust_region_surrogate


def _token_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, logp - old_logp, torch.zeros_like(logp))


# How the importance ratio of each token is formed: its own (PPO / GRPO) or its sequence's
# length-normalised one (GSPO-token).
RATIO_LEVELS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": _token_log_ratio,
    "sequence": gspo_log_ratio,
}

def _optional_kl_coef(name: str, value: Any) -> float | None:
    """A KL term's coefficient, or None to leave the term out."""
    return None if value is None else kl_coefficient(name, value)


class GRPOLoss(nn.Module):
    """GRPO loss on a batch of sampled responses, with optional KL leashes.

    Args:
        actor_network: the policy, a ``tether.models.TransformersWrapper`` or any ``tether.models.records.Scorer``
            (``score(tokens, attention_mask, *, with_entropy) -> TokenStats``; with ``scores_positions = True`` it
            is also handed ``where=`` and ``kl_to=``). Its temperature must be the sampling temperature.
        clip_epsilon: ``eps`` or ``(low, high)`` (clip-higher, DAPO): ratios are clipped to ``[1 - low, 1 + high]``.
        entropy_bonus: add ``-entropy_coeff * entropy`` to the loss.
        samples_mc_entropy: accepted for TorchRL compatibility and unused: the entropy of the categorical next-token
            distribution is exact, not a Monte-Carlo estimate.
        entropy_coeff: weight of the entropy bonus.
        aggregation: a mode of ``tether.ops.AGGREGATION_MODES`` (TorchRL's ``"token_mean"`` and ``"prompt_mean"``
            are accepted too); used for every ``loss_*`` term.
        kl_to_ref_coeff: weight of the KL term to the reference policy; ``None`` disables it (and the reference
            log-probs are then not needed).
        kl_to_inference_coeff: weight of the KL term to the sampling policy; ``None`` disables it.
        kl_estimator: ``"k3"`` or ``"k2"``, the per-token KL term (``tether.ops.kl_loss_term``).
        kl_correction: ``"importance"`` (expected gradient of KL(pi || target), also off-policy) or ``None`` (raw
            estimator: the GRPO paper / TorchRL term, whose k3 gradient is that of the forward KL). Both
            differentiate each token's KL with its context fixed; see the module docstring for the exact sequence
            gradient.
        device: accepted for TorchRL compatibility; the loss holds no buffers and computes on the device of the
            actor's log-probs.
        dual_clip: ``c > 1`` bounds the loss of negative-advantage tokens at ``-c A``.
        trust_region: a key of ``tether.ops.TRUST_REGIONS``: ``"clip"`` (PPO's ratio clip at ``clip_epsilon``),
            ``"dppo_tv"`` / ``"dppo_kl"`` (DPPO's masks of the sampled token's probability shift / Bernoulli KL to the
            sampling policy at ``trust_region_delta``) or ``"none"``; ``clip_fraction`` is the fraction it cut.
        trust_region_delta: the DPPO threshold ``d`` or ``(low, high)``.
        ratio_level: ``"token"`` (PPO / GRPO) or ``"sequence"`` (GSPO).
        importance_correction: ``None``, ``"tis"`` or ``"mis"``: reweight each token by ``w = pi_old / pi_sampler``
            truncated (TIS) or masked (MIS) at ``importance_cap``, for a sampler (e.g. vLLM) that disagrees with the
            trainer. ``pi_old`` is read from ``tensor_keys.old_log_probs`` (the trainer's log-probs under the
            weights that sampled) and is then also the ratio's denominator. If that key is absent, ``pi_old`` is
            taken as the current policy (detached): exact when each batch is used for one optimiser step (then the
            weights were not updated since sampling); with several steps per batch store the old log-probs, or the
            ratio stays 1 and the clip never acts. With ``None`` (default) the ratio is taken against the sampling
            log-probs, as in TorchRL, and no old log-probs are read.
        importance_cap: the TIS / MIS threshold (> 0).
        normalizer: the constant per-row divisor of ``"seq-mean-token-sum-norm"`` (e.g. the maximal response length,
            Dr. GRPO).
        masking_strategy: TorchRL 0.14's choice of trained tokens: ``"sft"`` and ``"rlhf"`` the assistant mask
            (tether's default), ``"generic"`` every valid token that has a prediction (``tensor_keys.loss_mask``
            None). ``kl_mask_threshold`` and a ``reduction`` other than ``"mean"`` (TorchRL 0.14) are refused by
            name with the change to make.

    ``forward(td, *, denominator=None)`` returns a ``GRPOLossOutput``. ``denominator`` replaces the outer count of
    the aggregation (see ``tether.ops.aggregate_denominator``): pass the full batch's count to every micro-batch and
    the summed micro-batch losses equal the full-batch loss, gradients included. Diagnostics (``clip_fraction``,
    ``kl_approx``, ``ESS``, ``entropy``, ``kl_to_ref``, ``kl_to_inference``) are masked token means of the batch
    passed in, whatever the aggregation mode.

    Examples:
        >>> import torch
        >>> from tether.llm import chat_batch
        >>> from tether.models import TransformersWrapper
        >>> from tether.models.tiny import byte_tokenizer, tiny_causal_lm
        >>> tok = byte_tokenizer(); policy = tiny_causal_lm(tok, dtype=torch.float64)
        >>> sampler = TransformersWrapper(policy, tok, generate_kwargs={"max_new_tokens": 4,
        ...                                                             "generator": torch.Generator().manual_seed(0)})
        >>> batch = sampler(chat_batch([[{"role": "user", "content": "Hi"}]] * 2, key=("history", "prompt")))
        >>> batch["advantage"] = torch.tensor([1.0, 0.5]).reshape(2, 1, 1)  # one per answer (TorchRL's layout)
        >>> scorer = TransformersWrapper(policy, tok, input_mode="tokens", generate=False)
        >>> out = GRPOLoss(scorer, entropy_bonus=False)(batch)
        >>> round(out.loss_objective.item(), 6)  # on-policy, ratio 1: -(4 * 1.0 + 4 * 0.5) / 8 (two 4-token answers)
        -0.75
    """

    _AcceptedKeys = GRPOKeys

    def __init__(
        self,
        actor_network: Any,
        *,
        clip_epsilon: float | tuple[float, float] = 0.2,
        entropy_bonus: bool = True,
        samples_mc_entropy: int = 1,
        entropy_coeff: float = 0.01,
        aggregation: str = "token-mean",
        kl_to_ref_coeff: float | None = None,
        kl_to_inference_coeff: float | None = None,
        kl_estimator: str = "k3",
        kl_correction: str | None = "importance",
        device: torch.device | str | None = None,
        dual_clip: float | None = None,
        ratio_level: str = "token",
        trust_region: str = "clip",
        trust_region_delta: float | tuple[float, float] = 0.2,
        importance_correction: str | None = None,
        importance_cap: float = 2.0,
        normalizer: float | None = None,
        masking_strategy: str | None = None,
        kl_mask_threshold: float | None = None,
        reduction: str | None = None,
    ) -> None:
        super().__init__()
        refuse_torchrl_only(kl_mask_threshold, reduction)
        keys = GRPOKeys() if masking_strategy is None else GRPOKeys(
            loss_mask=lookup(MASKING_STRATEGIES, masking_strategy, "masking_strategy"))
        if not callable(getattr(actor_network, "score", None)):
            raise TypeError(
                f"actor_network must have a score(tokens, attention_mask, *, with_entropy) method, as "
                f"tether.models.TransformersWrapper does; got {type(actor_network).__name__}."
            )
        if not isinstance(entropy_bonus, bool):
            raise TypeError(f"entropy_bonus must be a bool; got {type(entropy_bonus).__name__}.")
        whole_number("samples_mc_entropy", samples_mc_entropy, low=1)
        real_number("entropy_coeff", entropy_coeff)
        lookup(RATIO_LEVELS, ratio_level, "ratio_level")
        self.actor_network = actor_network
        self.clip_epsilon = clip_epsilon
        self.dual_clip = dual_clip
        self.trust_region, self.trust_region_delta = trust_region, trust_region_delta
        self.entropy_bonus = entropy_bonus
        self.samples_mc_entropy = samples_mc_entropy
        self.entropy_coeff = float(entropy_coeff)
        self.aggregation = AGGREGATION_ALIASES.get(aggregation, aggregation)
        self.normalizer = normalizer
        self.kl_to_ref_coeff = kl_to_ref_coeff
        self._kl_to_inference_coeff = _optional_kl_coef("kl_to_inference_coeff", kl_to_inference_coeff)
        self.kl_estimator = kl_estimator
        self.kl_correction = kl_correction
        self.ratio_level = ratio_level
        self.importance_correction = importance_correction
        self.importance_cap = importance_cap
        self.device = None if device is None else torch.device(device)
        self._tensor_keys = keys
        self._check_options()

    def _check_options(self) -> None:
        # Each option is checked by the op that reads it, under this class's name for it, so a
        # bad one fails here and not at the first step.
        clip_bounds(self.clip_epsilon)
        check_dual_clip(self.dual_clip)
        check_trust_region(self.trust_region, self.trust_region_delta)
        if self.normalizer is not None and self.aggregation != "seq-mean-token-sum-norm":
            raise ValueError(
                f"normalizer is only used by aggregation='seq-mean-token-sum-norm'; got aggregation="
                f"{self.aggregation!r} with normalizer={self.normalizer!r}. Drop normalizer or change the mode."
            )
        check_aggregation(self.aggregation, self.normalizer, argument="aggregation")
        check_kl_loss_options(self.kl_estimator, self.kl_correction, names=("kl_estimator", "kl_correction"))
        if self.importance_correction is not None:
            lookup(IMPORTANCE_WEIGHT_MODES, self.importance_correction, "importance_correction")
            real_number("importance_cap", self.importance_cap, low=0, low_open=True)

    # ------------------------------------------------------------------ keys and knobs
    @property
    def tensor_keys(self) -> GRPOKeys:
        """The TensorDict keys read by the loss (a ``GRPOKeys``); change them with ``set_keys``."""
        return self._tensor_keys

    def set_keys(self, **keys: Any) -> GRPOLoss:
        """Point entries at other keys, e.g. ``loss.set_keys(advantage="adv")``; returns self."""
        unknown = sorted(set(keys) - set(GRPOKeys.names()))
        if unknown:
            raise ValueError(f"set_keys: unknown entries {unknown}; the configurable ones are {list(GRPOKeys.names())}.")
        self._tensor_keys = dataclasses.replace(self._tensor_keys, **keys)
        return self

    @property
    def in_keys(self) -> list:
        keys = self._tensor_keys
        found = [keys.action, keys.attention_mask, *([keys.loss_mask] if keys.loss_mask else []),
                 keys.sample_log_prob, keys.advantage]
        return found + ([keys.ref_log_probs] if self.kl_to_ref_coeff is not None else [])

    @property
    def out_keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(GRPOLossOutput)]

    @property
    def kl_to_ref_coeff(self) -> float | None:
        return self._kl_to_ref_coeff

    @kl_to_ref_coeff.setter
    def kl_to_ref_coeff(self, value: float | None) -> None:
        self._kl_to_ref_coeff = _optional_kl_coef("kl_to_ref_coeff", value)

    @property
    def kl_coef(self) -> float | None:
        """Read/write alias of ``kl_to_ref_coeff``, the knob a KL controller drives."""
        return self.kl_to_ref_coeff

    @kl_coef.setter
    def kl_coef(self, value: float | None) -> None:
        self.kl_to_ref_coeff = value

    @property
    def kl_to_inference_coeff(self) -> float | None:
        return self._kl_to_inference_coeff

    @kl_to_inference_coeff.setter
    def kl_to_inference_coeff(self, value: float | None) -> None:
        self._kl_to_inference_coeff = _optional_kl_coef("kl_to_inference_coeff", value)

    # ------------------------------------------------------------------ the loss
    def forward(self, td: TensorDictBase, *, denominator: Tensor | float | None = None) -> GRPOLossOutput:
        """Loss terms and diagnostics of one (micro-)batch; ``td`` is left unchanged."""
        return self.reduce(self.token_terms(td), denominator=denominator)

    def token_terms(self, data: TensorDictBase | StepRecord) -> GRPOTokenTerms:
        """Every loss term and diagnostic of ``data`` per token (``[B, T]``), not yet reduced.

        ``data`` is a TensorDict under the loss's keys (the TorchRL-compatible edge) or a
        ``StepRecord``; both become one ``GRPOBatch`` and take the same path. A record that
        carries the reference's hidden states (``ref_hidden``) also gets the exact
        full-vocabulary KL to the reference per token (``kl_to_ref_exact``), computed from the
        policy's hidden states of this very pass: two head projections, no extra forward.
        """
        with_ref, with_old = self.kl_to_ref_coeff is not None, self.importance_correction is not None
        if isinstance(data, StepRecord):
            batch = grpo_batch_from_record(data, with_ref=with_ref, with_old=with_old)
            ref_hidden = data.ref_hidden
        else:
            batch = read_grpo_batch(data, self._tensor_keys, with_ref=with_ref, with_old=with_old)
            ref_hidden = None
        return self.terms(batch, ref_hidden=ref_hidden)

    def terms(self, batch: GRPOBatch, *, ref_hidden: HeadHidden | None = None) -> GRPOTokenTerms:
        """The tensor-level core of ``token_terms``: the per-token terms of one ``GRPOBatch``."""
        stats = self._score(batch, ref_hidden)
        if self.entropy_bonus and stats.entropy is None:
            raise TypeError(
                f"actor_network.score(..., with_entropy=True) returned no entropy ({type(self.actor_network).__name__}); "
                "return TokenStats.entropy or build the loss with entropy_bonus=False."
            )
        cur_all = stats.log_probs
        batch = batch.to(cur_all.device, cur_all.dtype)
        mask = batch.mask
        zero = torch.zeros_like(cur_all)
        cur = torch.where(mask, cur_all, zero)
        base = self._ratio_base(cur, batch)
        policy = trust_region_surrogate(
            RATIO_LEVELS[self.ratio_level](cur, base, mask), batch.advantage, cur, batch.sample_log_probs,
            kind=self.trust_region, clip_epsilon=self.clip_epsilon, delta=self.trust_region_delta,
            dual_clip=self.dual_clip)
        per_token = policy.loss
        if self.importance_correction is not None:
            per_token = per_token * importance_weights(
                base, batch.sample_log_probs, mask, mode=self.importance_correction, cap=self.importance_cap
            )
        detached = cur.detach()
        terms = GRPOTokenTerms(
            mask=mask,
            policy=per_token,
            clipped=policy.clipped.to(cur.dtype),
            ratio_gap=torch.where(mask, base - detached, zero),
            log_weights=torch.where(mask, detached - batch.sample_log_probs, zero),
        )
        if self.entropy_bonus:
            entropy = torch.where(mask, stats.entropy.to(cur.dtype), zero)
            # At coefficient 0 the entropy is a diagnostic: keeping it out of the graph lets the
            # head's backward skip its vocabulary-wide entropy gradient.
            terms.entropy = entropy if self.entropy_coeff else entropy.detach()
        if self.kl_to_ref_coeff is not None:
            terms.kl_to_ref_term, terms.kl_to_ref = self._kl(cur, batch.ref_log_probs, batch)
        if self.kl_to_inference_coeff is not None:
            terms.kl_to_inference_term, terms.kl_to_inference = self._kl(cur, batch.sample_log_probs, batch)
        if getattr(stats, "exact_kl", None) is not None:
            terms.kl_to_ref_exact = torch.where(mask, stats.exact_kl.to(cur.dtype), zero)
        return terms

    def _score(self, batch: GRPOBatch, ref_hidden: HeadHidden | None) -> TokenStats:
        """The policy's log-probs (and entropy) of the batch; with tether's own wrapper the head
        runs only on the trained tokens, and the exact KL comes along when ``ref_hidden`` is given."""
        actor = self.actor_network
        if not scores_positions(actor):  # the Scorer protocol's short form
            return actor.score(batch.tokens, batch.attention_mask, with_entropy=self.entropy_bonus)
        return actor.score(batch.tokens, batch.attention_mask, with_entropy=self.entropy_bonus, where=batch.mask,
                           kl_to=ref_hidden)

    def reduce(self, terms: GRPOTokenTerms, *, denominator: Tensor | float | None = None) -> GRPOLossOutput:
        """``aggregate`` every term of ``terms`` into the loss's output record.

        ``loss_*`` fields use the loss's aggregation mode (with ``denominator`` replacing its
        outer count, see ``tether.ops.aggregate_denominator``); diagnostics are masked token
        means, and ``ESS`` is the Kish effective sample size of the rows passed in divided by
        their valid-token count. Reducing the concatenation of micro-batches' detached terms
        (``GRPOTokenTerms.cat``) gives the full batch's diagnostics exactly.
        """
        mask = terms.mask
        reduce = partial(aggregate, mask=mask, mode=self.aggregation, normalizer=self.normalizer, denominator=denominator)
        mean = partial(aggregate, mask=mask, mode="token-mean")
        n_valid = mask.sum().clamp_min(1).to(terms.log_weights.dtype)
        out: dict[str, Tensor] = {
            "loss_objective": reduce(terms.policy),
            "clip_fraction": mean(terms.clipped),
            "kl_approx": mean(terms.ratio_gap),
            "ESS": effective_sample_size(terms.log_weights, mask) / n_valid,
        }
        if terms.entropy is not None:
            out["entropy"] = mean(terms.entropy.detach())
            out["loss_entropy"] = -self.entropy_coeff * reduce(terms.entropy)
        if terms.kl_to_ref_exact is not None:
            out["kl_to_ref_exact"] = mean(terms.kl_to_ref_exact)
        for name, coeff in (("kl_to_ref", self.kl_to_ref_coeff), ("kl_to_inference", self.kl_to_inference_coeff)):
            term, estimate = getattr(terms, f"{name}_term"), getattr(terms, name)
            if term is not None:
                if coeff is None:
                    raise ValueError(
                        f"GRPOLoss.reduce: the terms carry {name} but {name}_coeff is None now; reduce terms "
                        f"with the coefficients they were computed for (set {name}_coeff first)."
                    )
                out[f"loss_{name}"], out[name] = coeff * reduce(term), mean(estimate)
        return GRPOLossOutput(**out, batch_size=[])

    def _ratio_base(self, cur: Tensor, batch: GRPOBatch) -> Tensor:
        """Log-probs of the ratio's denominator: the sampler's, or the trainer's old ones."""
        if self.importance_correction is None:
            return batch.sample_log_probs
        if batch.old_log_probs is not None:
            return batch.old_log_probs
        return cur.detach()

    def _kl(self, cur: Tensor, target: Tensor, batch: GRPOBatch) -> tuple[Tensor, Tensor]:
        """Per-token (KL loss term, detached KL estimate) against ``target``, 0 outside the mask."""
        # The samples were drawn by the sampler, so its log-probs weight the importance form.
        old = batch.sample_log_probs if self.kl_correction == "importance" else None
        term = kl_loss_term(cur, target, estimator=self.kl_estimator, old_logp=old, correction=self.kl_correction)
        estimate = kl_estimate(cur.detach(), target, self.kl_estimator)
        zero = torch.zeros_like(cur)
        return torch.where(batch.mask, term, zero), torch.where(batch.mask, estimate, zero)

    def extra_repr(self) -> str:
        return (
            f"clip_epsilon={self.clip_epsilon}, trust_region={self.trust_region!r}, aggregation={self.aggregation!r}, "
            f"ratio_level={self.ratio_level!r}, "
            f"kl_to_ref_coeff={self.kl_to_ref_coeff}, kl_estimator={self.kl_estimator!r}, "
            f"kl_correction={self.kl_correction!r}, entropy_coeff={self.entropy_coeff if self.entropy_bonus else None}"
        )
