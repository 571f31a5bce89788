"""The typed records of a training step, from sampling to the loss: tether's leaf types.

``StepRecord`` is one step's batch: sampling produces it, the reward, reference and advantage
stages fill its fields, and the loss reads it; no stage looks a tensor up by a TensorDict key.
TensorDicts stay at the TorchRL edge (``from_tensordict`` / ``to_tensordict``). ``HeadHidden``
is a model's kept hidden states at chosen positions with its output head (what a reference
pass hands the loss pass for the exact KL); ``ScoredTokens`` what a scoring call returns;
``Scorer`` what a loss needs of its policy. ``GRPOTokenTerms`` holds every loss term per token
and ``GRPOLossOutput`` their reduction through ``tether.ops.aggregate``: a tensorclass with
TorchRL's field names (``to_tensordict()``, ``out.loss_objective``), every ``loss_*`` field
differentiable and reduced, every other a detached diagnostic. Because a batch's per-token
record is the concatenation of its micro-batches', reducing the concatenated detached terms
once gives the full batch's diagnostics exactly (ESS included, which is not a token mean).

They live in ``tether.models`` because the components that fill them (``tether.rollout``,
``tether.objectives``) and the recipes may all import this layer, not each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional, Protocol

import torch
from tensordict import tensorclass
from torch import Tensor

from tether.ops import TokenStats, kl_k1


@dataclass(frozen=True)
class HeadHidden:
    """A model's last hidden states at chosen positions of a batch, and its output head.

    Attributes:
        hidden: ``[N, H]``, one row per position of the scoring call's ``where`` mask, in
            row-major order (row by row, left to right). Detached.
        weight: ``[V, H]`` head weight. bias: ``[V]`` or None.
    """

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None = None

    def rows(self, where: Tensor, begin: int, end: int) -> HeadHidden:
        """The part belonging to rows ``begin:end`` of the batch whose ``where [B, T]`` made it."""
        counts = where.sum(-1)
        first = int(counts[:begin].sum())
        return HeadHidden(self.hidden[first : first + int(counts[begin:end].sum())], self.weight, self.bias)

    def take(self, where: Tensor, index: Tensor) -> HeadHidden:
        """The parts belonging to rows ``index`` (``long [N]``, any order) of the batch whose ``where``
        made it, in that order."""
        counts = where.sum(-1).to(self.hidden.device)
        index = index.to(counts.device)
        starts, picked = counts.cumsum(0) - counts, counts[index]
        out_starts = picked.cumsum(0) - picked
        source = torch.arange(int(picked.sum()), device=counts.device) + torch.repeat_interleave(
            starts[index] - out_starts, picked)
        return HeadHidden(self.hidden[source], self.weight, self.bias)

    @staticmethod
    def cat(parts: list[HeadHidden]) -> HeadHidden:
        """Several batches' hidden states, rows stacked in order; one output head for all."""
        head = parts[0]
        if any(not (p.weight is head.weight or torch.equal(p.weight, head.weight)) for p in parts[1:]):
            raise ValueError("HeadHidden.cat: the parts were kept with different output heads; join hidden "
                             "states of one model and step only.")
        return HeadHidden(torch.cat([p.hidden for p in parts]), head.weight, head.bias)


@dataclass(frozen=True)
class ScoredTokens(TokenStats):
    """``TokenStats`` plus what a scoring call was asked to keep or compare.

    Attributes:
        log_probs: as ``TokenStats``; None when the call passed ``log_probs=False``.
        hidden: the model's hidden states at ``where`` (``keep_hidden=True``), else None.
        exact_kl: ``[B, T]`` full-vocabulary ``KL(model || other)`` at ``where`` against the
            ``kl_to`` hidden states (0 elsewhere, no gradient), else None.
    """

    log_probs: Tensor | None  # None when the call was asked for no log-probs (``log_probs=False``)
    hidden: HeadHidden | None = None
    exact_kl: Tensor | None = None


class Scorer(Protocol):
    """What a loss needs of its policy: per-token log-probs (and entropy) of a batch.

    The short form is ``score(tokens, attention_mask, *, with_entropy) -> TokenStats``. A scorer
    that also takes ``where=`` (score only those positions) and ``kl_to=`` (the exact KL against
    another model's kept hidden states), as ``TransformersWrapper`` does, says so with
    ``scores_positions = True``; callers read that flag, never the scorer's type.
    """

    scores_positions: bool

    def score(self, tokens: Tensor, attention_mask: Tensor, *, with_entropy: bool = False,
              **positions: Any) -> TokenStats: ...


def scores_positions(scorer: object) -> bool:
    """Whether ``scorer.score`` takes ``where=`` and ``kl_to=`` (``Scorer``'s full form)."""
    return bool(getattr(scorer, "scores_positions", False))


# Where the TorchRL-API components keep each tensor of a rollout (the TorchRL LLM layout).
TD_KEYS: dict[str, Any] = {
    "tokens": ("tokens", "full"),
    "attention_mask": ("masks", "all_attention_mask"),
    "assistant_mask": ("masks", "all_assistant_mask"),
    "sample_log_probs": ("log_probs", "full"),
    "ref_log_probs": ("ref_log_probs", "full"),
    "old_log_probs": ("old_log_probs", "full"),
    "advantages": "advantage",
}
_ROW_FIELDS = ("tokens", "attention_mask", "assistant_mask", "group_ids", "sample_log_probs", "ref_log_probs",
               "old_log_probs", "rewards", "advantages")


def group_ids(answers: int, group_size: int) -> Tensor:
    """``[answers]`` the group (problem) of each answer; a group's answers are consecutive."""
    return torch.arange(answers // group_size).repeat_interleave(group_size)


@dataclass
class StepRecord:
    """The step's ``B`` sampled answers on one ``[B, T]`` token grid.

    Attributes:
        tokens: ``long [B, T]`` prompt and answer ids.
        attention_mask: ``bool [B, T]`` valid tokens (one contiguous run per row).
        assistant_mask: ``bool [B, T]`` the tokens trained on and leashed: every assistant
            token (across turns), none a prompt, user or tool wrote.
        group_ids: ``long [B]`` the prompt (group) each answer belongs to.
        sample_log_probs: ``[B, T]`` log-probs of the sampled tokens under the sampler.
        responses: the ``B`` answers as text (what rewards read).
        ref_log_probs: ``[B, T]`` the reference's log-probs (reference stage).
        ref_hidden: the reference's hidden states at ``assistant_mask`` (reference stage,
            when the exact KL is measured in the loss pass).
        rewards: ``[B]`` (reward stage). advantages: ``[B, T]``, 0 off the mask (advantage stage).
        old_log_probs: ``[B, T]`` the policy's log-probs before this step's first update
            (only with several updates per rollout and an importance correction).
        episode: ``[B]`` counters of a multi-turn rollout (``turns``, ``tool_calls``,
            ``tool_errors``); empty for single-turn answers.
    """

    tokens: Tensor
    attention_mask: Tensor
    assistant_mask: Tensor
    group_ids: Tensor
    sample_log_probs: Tensor
    responses: list[str] = field(default_factory=list)
    ref_log_probs: Tensor | None = None
    ref_hidden: HeadHidden | None = None
    rewards: Tensor | None = None
    advantages: Tensor | None = None
    old_log_probs: Tensor | None = None
    episode: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        grid = tuple(self.tokens.shape)
        for name in ("attention_mask", "assistant_mask", "sample_log_probs"):
            value = getattr(self, name)
            if tuple(value.shape) != grid:
                raise ValueError(f"StepRecord.{name}: expected the tokens' shape {grid}, got {tuple(value.shape)}.")
        for name in ("attention_mask", "assistant_mask"):
            if getattr(self, name).dtype != torch.bool:
                raise TypeError(f"StepRecord.{name}: expected a bool mask, got {getattr(self, name).dtype}.")
        if tuple(self.group_ids.shape) != grid[:1]:
            raise ValueError(f"StepRecord.group_ids: expected [{grid[0]}], got {tuple(self.group_ids.shape)}.")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, begin: int, end: int) -> StepRecord:
        """Rows ``begin:end`` (a micro- or mini-batch) with every field cut alike."""
        cut = {name: None if getattr(self, name) is None else getattr(self, name)[begin:end] for name in _ROW_FIELDS}
        hidden = None if self.ref_hidden is None else self.ref_hidden.rows(self.assistant_mask, begin, end)
        return replace(self, **cut, responses=self.responses[begin:end], ref_hidden=hidden,
                       episode={k: v[begin:end] for k, v in self.episode.items()})

    def take(self, index: Tensor) -> StepRecord:
        """Rows ``index`` (``long [N]``, any order) with every field taken alike."""
        cut = {name: None if getattr(self, name) is None else getattr(self, name)[index] for name in _ROW_FIELDS}
        hidden = None if self.ref_hidden is None else self.ref_hidden.take(self.assistant_mask, index)
        picked = index.tolist()
        return replace(self, **cut, responses=[self.responses[i] for i in picked] if self.responses else [],
                       ref_hidden=hidden, episode={k: v[index] for k, v in self.episode.items()})

    @classmethod
    def cat(cls, parts: list[StepRecord]) -> StepRecord:
        """Several records' rows stacked along ``B`` on the widest grid: a narrower one gets columns
        on the right that no mask covers (ids, log-probs 0). Fields must be present in all or none."""
        if not parts:
            raise ValueError("StepRecord.cat: expected at least one record.")
        width = max(part.tokens.shape[1] for part in parts)
        joined: dict[str, Any] = {}
        for name in (*_ROW_FIELDS, "ref_hidden"):
            values = [getattr(part, name) for part in parts]
            if any((v is None) != (values[0] is None) for v in values):
                raise ValueError(f"StepRecord.cat: {name!r} is set in some records and not in others.")
            if values[0] is None:
                joined[name] = None
            elif name == "ref_hidden":  # kept per answer token, row-major: rows stacked in order
                joined[name] = HeadHidden.cat(values)
            else:
                joined[name] = torch.cat([v if v.dim() == 1 else torch.nn.functional.pad(v, (0, width - v.shape[1]))
                                          for v in values])
        keys = set(parts[0].episode)
        if any(set(part.episode) != keys for part in parts):
            raise ValueError("StepRecord.cat: the records' episode counters differ in their keys.")
        return cls(**joined, responses=[r for part in parts for r in part.responses],
                   episode={k: torch.cat([part.episode[k] for part in parts]) for k in keys})

    def token_log_ratio(self) -> Tensor:
        """``[B, T]`` ``log pi_sampler - log pi_ref`` at the answer tokens (0 elsewhere): the k1 terms."""
        if self.ref_log_probs is None:
            raise ValueError("StepRecord.ref_log_probs is None: run the reference stage before asking for the KL.")
        return kl_k1(self.sample_log_probs, self.ref_log_probs) * self.assistant_mask

    def sequence_log_ratio(self) -> Tensor:
        """``[B]`` the k1 terms summed over each answer: the sampled KL per answer."""
        return self.token_log_ratio().sum(-1)

    @classmethod
    def from_tensordict(cls, td: Any, group_ids: Tensor) -> StepRecord:
        """Read a rollout written by the TorchRL-API components (keys in ``TD_KEYS``)."""
        keys = set(td.keys(include_nested=True, leaves_only=True))
        values = {name: td.get(key) for name, key in TD_KEYS.items() if key in keys}
        missing = [TD_KEYS[n] for n in ("tokens", "attention_mask", "assistant_mask", "sample_log_probs") if n not in values]
        if missing:
            raise KeyError(f"rollout: missing {missing}; a sampler with generate=True writes them. Present: {sorted(map(str, keys))}.")
        values["attention_mask"] = values["attention_mask"].bool()
        values["assistant_mask"] = values["assistant_mask"].bool()
        responses = td.get(("text", "response"), None)
        episode = {k[1]: td.get(k) for k in keys if isinstance(k, tuple) and k[0] == "episode"}
        return cls(group_ids=group_ids, responses=[] if responses is None else list(responses.tolist()),
                   episode=episode, **values)

    def to_tensordict(self) -> Any:
        """The record under TorchRL's keys (``TD_KEYS``), for TorchRL-style consumers."""
        from tensordict import TensorDict

        td = TensorDict(batch_size=[len(self)])
        for name, key in TD_KEYS.items():
            if getattr(self, name) is not None:
                td.set(key, getattr(self, name))
        for name, value in self.episode.items():
            td.set(("episode", name), value)
        td.set("group_ids", self.group_ids)
        return td


LOSS_FIELDS = ("loss_objective", "loss_entropy", "loss_kl_to_ref", "loss_kl_to_inference")


@tensorclass(nocast=True)
class GRPOLossOutput:
    """Scalars of one ``GRPOLoss`` call.

    Attributes:
        loss_objective: clipped surrogate, reduced with the loss's aggregation mode.
        clip_fraction: fraction of valid tokens whose gradient a clip cut.
        kl_approx: masked mean of ``log pi_old - log pi`` (the ratio's denominator minus
            the current log-prob), a k1 estimate of ``KL(pi_old || pi)``.
        ESS: effective sample size of the per-token weights ``pi / pi_sampler`` over the
            valid tokens, divided by their number (1 when all weights are equal).
        entropy: masked mean entropy of the current policy (``None`` without the bonus).
        loss_entropy: ``-entropy_coeff * aggregate(entropy)`` (``None`` without the bonus).
        loss_kl_to_ref: ``kl_to_ref_coeff * aggregate(KL term)`` (``None`` when disabled).
        kl_to_ref: masked mean of the per-token KL estimate to the reference.
        loss_kl_to_inference: ``kl_to_inference_coeff * aggregate(KL term)`` to the
            sampling policy (``None`` when disabled).
        kl_to_inference: masked mean of the per-token KL estimate to the sampling policy.
        kl_to_ref_exact: masked mean of the exact full-vocabulary KL to the reference per
            token (only when the batch carried the reference's hidden states).
    """

    loss_objective: Tensor
    clip_fraction: Tensor
    kl_approx: Tensor
    ESS: Tensor
    entropy: Optional[Tensor] = None
    loss_entropy: Optional[Tensor] = None
    loss_kl_to_ref: Optional[Tensor] = None
    kl_to_ref: Optional[Tensor] = None
    loss_kl_to_inference: Optional[Tensor] = None
    kl_to_inference: Optional[Tensor] = None
    kl_to_ref_exact: Optional[Tensor] = None

    def total_loss(self) -> torch.Tensor:
        """Sum of the ``loss_*`` terms that are present: the scalar to call ``backward`` on."""
        total = self.loss_objective
        for name in LOSS_FIELDS[1:]:
            term = getattr(self, name)
            if term is not None:
                total = total + term
        return total

    @property
    def loss(self) -> torch.Tensor:
        """Alias of ``total_loss()``."""
        return self.total_loss()


@dataclass
class GRPOTokenTerms:
    """Every term of one ``GRPOLoss`` call, per token, before reduction.

    Every tensor is ``[B, T]`` on the batch's token grid and 0 outside ``mask``. Fields
    marked differentiable carry the graph to the policy (unless ``detach()`` was called).

    Attributes:
        mask: ``bool [B, T]``, the tokens trained on.
        policy: clipped surrogate loss per token (importance-weighted if asked); differentiable.
        clipped: 1.0 where a clip cut the token's gradient, else 0.0.
        ratio_gap: ``log pi_old - log pi`` (detached): its mean is ``kl_approx``.
        log_weights: ``log pi - log pi_sampler`` (detached): the ESS log-weights.
        entropy: policy entropy per token, or ``None`` without the bonus; differentiable
            when the entropy coefficient is non-zero.
        kl_to_ref_term / kl_to_ref: the KL loss term (differentiable) and the detached KL
            estimate against the reference, or ``None`` when that leash is off.
        kl_to_inference_term / kl_to_inference: the same against the sampling policy.
        kl_to_ref_exact: the exact full-vocabulary KL to the reference (detached), or
            ``None`` when the batch carried no reference hidden states.
    """

    mask: Tensor
    policy: Tensor
    clipped: Tensor
    ratio_gap: Tensor
    log_weights: Tensor
    entropy: Optional[Tensor] = None
    kl_to_ref_term: Optional[Tensor] = None
    kl_to_ref: Optional[Tensor] = None
    kl_to_inference_term: Optional[Tensor] = None
    kl_to_inference: Optional[Tensor] = None
    kl_to_ref_exact: Optional[Tensor] = None

    def detach(self) -> "GRPOTokenTerms":
        """The same values cut from the graph (what a caller keeps after ``backward``)."""
        return GRPOTokenTerms(**{
            f.name: None if getattr(self, f.name) is None else getattr(self, f.name).detach() for f in fields(self)
        })

    @classmethod
    def cat(cls, parts: "list[GRPOTokenTerms]") -> "GRPOTokenTerms":
        """Rows of several micro-batches (same ``T``, same terms present) stacked along ``B``."""
        if not parts:
            raise ValueError("GRPOTokenTerms.cat: expected at least one micro-batch's terms; got an empty list.")
        joined = {}
        for f in fields(cls):
            values = [getattr(part, f.name) for part in parts]
            if any((v is None) != (values[0] is None) for v in values):
                raise ValueError(f"GRPOTokenTerms.cat: {f.name!r} is present in some micro-batches and not in others.")
            joined[f.name] = None if values[0] is None else torch.cat(values, dim=0)
        return cls(**joined)
