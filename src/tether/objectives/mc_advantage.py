"""``MCAdvantage``: group complete trajectories by prompt and emit them with advantages.

On the replay-buffer write path (``add``, alias ``_inv_call`` for TorchRL) each complete
trajectory is queued under its prompt; when ``grpo_size`` of one prompt are in, the group is
returned with an advantage entry and its queue emptied (TorchRL's sliding window re-emitted
duplicates). Batches read as ``[..., steps]``; every trajectory must end with ``done``; prompts
are strings or chats; a whole ``add`` is checked before anything is queued; a plain module is
wrapped for TorchRL's buffers (``tether.integrations.torchrl.as_replay_buffer_transform``).
``compute(rewards, group_ids, mask=None)`` is the vectorised path. Rationale: docs/design.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDictBase
from tensordict.utils import NestedKey
from torch import Tensor, nn

from tether.models.batch_io import fetch, has_key
from tether.objectives.group_advantage import check_advantage_options, mc_group_advantages
from tether.ops.checks import whole_number
from tether.ops import nested_to_padded, padded_to_nested, ragged_dim_of
from tether.ops.masks import pad_rows

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class _RewardEntries:
    """A trajectory's reward entries on a ``[L, W]`` grid and how to write results back."""

    values: Tensor  # [L, W]
    mask: Tensor  # bool [L, W]
    restore: Callable[[Tensor], Tensor]  # [L, W] advantages -> the reward's own layout


def _jagged_safe(operation: Callable[[], Any], what: str) -> Any:
    """Run a TensorDict split/cat; explain the failure older tensordict versions give on jagged entries."""
    try:
        return operation()
    except RuntimeError as err:
        if "NestedTensor" not in str(err):
            raise
        raise ValueError(
            f"cannot {what} a TensorDict holding jagged (nested) entries with this tensordict version "
            f"({err}). Store per-token rewards padded with their mask under mask_key, or use tensordict >= 0.15."
        ) from err


def prompt_group_key(prompt: Any) -> str:
    """A hashable queue key for a prompt: the string itself, or a hash of a chat's canonical JSON."""
    if isinstance(prompt, str):
        return "text:" + prompt
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        try:
            canonical = json.dumps(list(prompt), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except TypeError as err:
            raise TypeError(f"prompt: a chat must hold JSON-serialisable messages; {err}.") from err
        return "chat:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    raise TypeError(
        f"prompt: expected a string or a chat (a list of {{'role', 'content'}} dicts), got "
        f"{type(prompt).__name__}. Point prompt_key at the prompt text, e.g. ('text', 'prompt'), "
        "or at the prompt chat, e.g. ('history', 'prompt')."
    )


class MCAdvantage(nn.Module):
    """Monte-Carlo group advantage over complete trajectories sharing a prompt.

    Args:
        grpo_size: trajectories per prompt that make a group (>= 2).
        prompt_key: key of the prompt (string or chat) in the first step of a trajectory.
        rewards_key: key of the rewards: ``[L]`` / ``[L, 1]`` / ``[L, 1, 1]`` per step (the
            last is TorchRL's one reward per answer), or per token
            ``[L, T]`` / ``[L, T, 1]`` (padded, mask under ``mask_key``) or jagged.
        advantage_key: where the advantage is written, in the reward's own layout.
        done_key: key of the done flags; the last step of each trajectory must be done.
        verbose: log each emitted group at INFO level.
        mode: ``"grpo"``, ``"dr_grpo"`` or ``"rloo"`` (``tether.ops.group_advantages``).
        std: ``"unbiased"`` or ``"population"`` spread for ``grpo``.
        reward_to_go: per-token returns instead of per-entry rewards (per-token KL shaping).
        mask_key: valid-entry mask of padded per-token rewards.
        trajectory_return: TorchRL 0.14's keyword; only its default, None, is accepted.

    ``prompt_key`` defaults to TorchRL 0.13's ``"text"``; TorchRL 0.14 reads ``"query"``
    (pass ``prompt_key="query"``; a missing ``"text"`` next to a ``"query"`` says so).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tether.objectives import MCAdvantage
        >>> batch = TensorDict({("next", "reward"): torch.tensor([1.0, 0.0, 2.0, 2.0]).reshape(4, 1, 1),
        ...                     ("next", "done"): torch.ones(4, 1, dtype=torch.bool)}, [4])
        >>> batch["text"] = ["2+2?", "2+2?", "3+1?", "3+1?"]  # the prompts; two answers each
        >>> out = MCAdvantage(grpo_size=2).add(batch)  # both groups complete: emitted with advantages
        >>> out["advantage"].flatten()  # (r - mean) / (std + 1e-6) per group; a constant group gets 0
        tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
    """

    def __init__(
        self,
        grpo_size: int,
        prompt_key: NestedKey = "text",
        rewards_key: NestedKey = ("next", "reward"),
        advantage_key: NestedKey = "advantage",
        done_key: NestedKey = ("next", "done"),
        verbose: bool = False,
        *,
        mode: str = "grpo",
        std: str = "unbiased",
        reward_to_go: bool = False,
        mask_key: NestedKey = ("masks", "all_assistant_mask"),
        trajectory_return: str | None = None,
    ) -> None:
        super().__init__()
        if trajectory_return is not None:
            raise TypeError(
                f"MCAdvantage: trajectory_return={trajectory_return!r} (TorchRL 0.14's per-trajectory return) is "
                "not supported; drop it. Each step's reward is normalised over the group's steps, as with "
                "TorchRL's default (None); per-token KL-shaped rewards take reward_to_go=True."
            )
        whole_number("grpo_size", grpo_size, low=2,
                     fix="It counts the trajectories per prompt; a group of one has no baseline (its "
                         "advantage is 0 in every mode), so nothing would be learnt.")
        check_advantage_options(mode, std)
        self.grpo_size = grpo_size
        self.prompt_key = prompt_key
        self.rewards_key = rewards_key
        self.advantage_key = advantage_key
        self.done_key = done_key
        self.verbose = verbose
        self.mode = mode
        self.std = std
        self.reward_to_go = bool(reward_to_go)
        self.mask_key = mask_key
        self.in_keys = [self.prompt_key, self.rewards_key, self.done_key]
        self.out_keys = [advantage_key]
        self.queues: defaultdict[str, list[TensorDictBase]] = defaultdict(list)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        """Reading from a buffer changes nothing: the advantage was written by ``add``.

        Raises a ``KeyError`` when ``td`` holds no advantage: the data never went through
        ``add`` (e.g. a TorchRL replay buffer given this module unwrapped). A buffer wraps any
        callable that is not a TorchRL ``Transform`` so that its write path is the identity and
        only this method runs, on sampled steps; grouping needs the write path, and only a
        ``Transform`` subclass (TorchRL itself) reaches it, hence the wrapper.
        """
        if td.numel() and not has_key(td, self.advantage_key):
            raise KeyError(
                f"{self.advantage_key!r}: MCAdvantage.forward got data without an advantage, so "
                "it was never passed through add() (the write path). A TorchRL ReplayBuffer only "
                "calls the write path of TorchRL transforms: pass transform="
                "tether.integrations.torchrl.as_replay_buffer_transform(MCAdvantage(...)), or "
                "call add() on complete trajectories yourself. With append_transform the one-line "
                "change is rb.append_transform(as_replay_buffer_transform(MCAdvantage(...))); the "
                "trajectories extended so far were stored without advantages, so extend them again."
            )
        return td

    def compute(self, rewards: Tensor, group_ids: Tensor, mask: Tensor | None = None) -> Tensor:
        """Advantages of a whole batch of complete trajectories in one pass.

        Args:
            rewards: ``[N]``, ``[N, 1]``, ``[N, T]`` or ``[N, T, 1]``.
            group_ids: ``[N]`` integer prompt labels.
            mask: ``bool [N, T]`` valid entries of per-token rewards (None: all).

        Returns:
            Advantages with the shape of ``rewards`` (see ``mc_group_advantages``).
        """
        return mc_group_advantages(
            rewards, group_ids, mask, mode=self.mode, std=self.std, reward_to_go=self.reward_to_go
        )

    def add(self, tensordict: TensorDictBase) -> TensorDictBase | None:
        """Queue the complete trajectories of ``tensordict``; return the groups it completes.

        Args:
            tensordict: one trajectory ``[L]`` (steps), several back to back (split at the
                done flags), or ``[..., L]`` rows of them. A 0-dim TensorDict is one step.

        Returns:
            The completed groups concatenated along the step dim, each with
            ``advantage_key`` set, or ``None`` when no group is complete yet. The input
            TensorDict is never modified.
        """
        if not isinstance(tensordict, TensorDictBase):
            raise TypeError(f"tensordict: expected a TensorDict, got {type(tensordict).__name__}.")
        # Check every trajectory before queueing any: a bad one must not strand or drop others.
        keyed = [(self._group_key(traj), traj) for traj in self._trajectories(tensordict)]
        for _, traj in keyed:
            self._entries(traj)
        emitted = [group for key, traj in keyed if (group := self._enqueue(key, traj)) is not None]
        if not emitted:
            return None
        return _jagged_safe(lambda: torch.cat(emitted, 0), "concatenate")

    _inv_call = add  # the name TorchRL's replay buffers call on write
    inv = add

    def pending(self) -> dict[str, int]:
        """Queued trajectory count per prompt key (see ``prompt_group_key``)."""
        return {key: len(queue) for key, queue in self.queues.items() if queue}

    def reset(self) -> None:
        """Drop every queued trajectory."""
        self.queues.clear()

    # ------------------------------------------------------------------ splitting
    def _trajectories(self, td: TensorDictBase) -> list[TensorDictBase]:
        if td.batch_dims == 0:
            td = td.unsqueeze(0)
        if td.batch_dims > 1:
            rows = td.reshape(-1, td.shape[-1])
            return [traj for row in rows.unbind(0) for traj in self._split_row(row)]
        return self._split_row(td)

    def _split_row(self, td: TensorDictBase) -> list[TensorDictBase]:
        if td.shape[0] == 0:
            return []
        done = fetch(td, self.done_key, "done flags")
        done = done.reshape(td.shape[0], -1).any(-1)
        ends = torch.nonzero(done).flatten() + 1
        if not bool(done[-1]):
            last = int(ends[-1]) if ends.numel() else 0
            raise ValueError(
                f"{self.done_key!r}: expected complete trajectories, but the last "
                f"{td.shape[0] - last} step(s) of a batch of {td.shape[0]} are not followed by a "
                "done step. Add trajectories only once they are done (buffer the steps until "
                "done=True)."
            )
        sizes = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
        return list(_jagged_safe(lambda: td.split(sizes, 0), "split")) if len(sizes) > 1 else [td]

    # ------------------------------------------------------------------ grouping
    def _group_key(self, traj: TensorDictBase) -> str:
        first = traj[0]
        if self.prompt_key == "text" and not has_key(first, "text") and has_key(first, "query"):
            raise KeyError(
                "'text': MCAdvantage's prompt_key defaults to TorchRL 0.13's 'text', and this trajectory has "
                "'query' instead (TorchRL 0.14's default). Pass MCAdvantage(..., prompt_key='query')."
            )
        prompt = fetch(first, self.prompt_key, "the prompt")
        if isinstance(prompt, (NonTensorData, NonTensorStack)):
            prompt = prompt.tolist()
        if isinstance(prompt, TensorDictBase):
            raise TypeError(
                f"prompt_key={self.prompt_key!r} points at a sub-TensorDict with keys "
                f"{sorted(str(k) for k in prompt.keys())}, not at a prompt. Use e.g. "
                f"prompt_key=('text', 'prompt') or ('history', 'prompt')."
            )
        return prompt_group_key(prompt)

    def _enqueue(self, key: str, traj: TensorDictBase) -> TensorDictBase | None:
        group = [*self.queues[key], traj]
        if len(group) < self.grpo_size:
            self.queues[key].append(traj)
            return None
        out = self._with_advantages(group, key)  # if this raises, the queue is as it was
        del self.queues[key]
        return out

    def _with_advantages(self, group: list[TensorDictBase], key: str) -> TensorDictBase:
        entries = [self._entries(traj) for traj in group]
        flat = [e.values[e.mask] for e in entries]
        grid = pad_rows(flat)
        advantages = self.compute(grid.values, torch.zeros(len(group), dtype=torch.long), grid.mask)
        if self.verbose:
            _LOG.info("MCAdvantage: group of %d trajectories for %s, rewards %s", len(group), key[:48], flat)
        out = []
        for traj, entry, row, count in zip(group, entries, advantages, grid.mask.sum(-1).tolist()):
            full = advantages.new_zeros(entry.values.shape).masked_scatter(entry.mask, row[:count])
            traj = traj.copy()
            traj.set(self.advantage_key, entry.restore(full))
            out.append(traj)
        return _jagged_safe(lambda: torch.cat(out, 0), "concatenate")

    def _entries(self, traj: TensorDictBase) -> _RewardEntries:
        reward = fetch(traj, self.rewards_key, "the rewards")
        steps = traj.shape[0]
        if reward.is_nested:
            return self._nested_entries(reward)
        if self._unpadded_steps(traj, reward):
            # Steps stacked lazily carry no padding: equal token counts read as a dense grid.
            values = reward.reshape(steps, -1)
            ones = torch.ones(values.shape, dtype=torch.bool, device=values.device)
            return _RewardEntries(values, ones, lambda adv: adv.reshape(reward.shape))
        if reward.numel() == steps and reward.dim() <= 3:
            # One reward per step ([L], [L, 1], TorchRL's per-answer [L, 1, 1]): no token mask applies.
            values = reward.reshape(steps, 1)
            ones = torch.ones(values.shape, dtype=torch.bool, device=values.device)
            return _RewardEntries(values, ones, lambda adv: adv.reshape(reward.shape))
        if reward.dim() == 2 or (reward.dim() == 3 and reward.shape[-1] == 1):
            values = reward.reshape(steps, -1)
            mask = fetch(traj, self.mask_key, "the valid-token mask of the padded per-token rewards")
            if mask.shape != values.shape:
                raise ValueError(
                    f"{self.mask_key!r}: expected a mask of shape {tuple(values.shape)} matching the per-token "
                    f"rewards {self.rewards_key!r}, got {tuple(mask.shape)}."
                )
            return _RewardEntries(values, mask.bool(), lambda adv: adv.reshape(reward.shape))
        raise ValueError(
            f"{self.rewards_key!r}: expected rewards [L], [L, 1], [L, T] or [L, T, 1] per trajectory, "
            f"got shape {tuple(reward.shape)}."
        )

    def _unpadded_steps(self, traj: TensorDictBase, reward: Tensor) -> bool:
        """A lazy stack of steps, no mask, one token axis: every reward entry is valid."""
        token_axes = sum(size > 1 for size in reward.shape[1:])
        return isinstance(traj, LazyStackedTensorDict) and token_axes <= 1 and not has_key(traj, self.mask_key)

    def _nested_entries(self, reward: Tensor) -> _RewardEntries:
        """Entries of a jagged reward ``[L, *pre, j, *post]`` whose other dims are singletons."""
        ragged = ragged_dim_of(reward)
        padded = nested_to_padded(reward, padding_side="right")
        steps, width = padded.mask.shape
        if padded.values.numel() != steps * width:
            raise ValueError(
                f"{self.rewards_key!r}: expected one jagged reward entry per token (rows [n], [n, 1] or "
                f"[1, n, 1]), got rows of shape {tuple(reward.shape[1:])}. Store one reward per token."
            )
        shape = padded.values.shape

        def restore(adv: Tensor) -> Tensor:
            return padded_to_nested(adv.reshape(shape), padded.mask, ragged_dim=ragged)

        return _RewardEntries(padded.values.reshape(steps, width), padded.mask, restore)
