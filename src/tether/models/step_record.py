"""``StepRecord``: one training step's batch as typed tensors, from sampling to the loss.

Sampling produces it, the reward, reference and advantage stages fill their fields, and
the loss reads it; no stage looks a tensor up by a TensorDict key. TensorDicts stay at
the edge where TorchRL compatibility needs them: ``from_tensordict`` reads a rollout written
by the TorchRL-API components once, ``to_tensordict`` writes TorchRL's keys back.

It lives in ``tether.models`` because both the components that fill it (``tether.rollout``)
and the loss that reads it (``tether.objectives``) may import this layer, not each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from tether.models.score_sink import HeadHidden
from tether.ops import kl_k1

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

