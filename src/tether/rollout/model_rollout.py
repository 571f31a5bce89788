"""``RolloutFromModel``: sample responses from a causal LM and lay them out as RL episodes.

Each prompt becomes an episode of ``max_new_tokens`` steps in TorchRL's TensorDict layout
(``action``, ``sample_log_prob``, ``("next", reward / done / terminated ...)``, batch ``[B, N]``).
The reward is the reward model's score of the finished sequence minus that of the reference
completion, clipped and paid at the last step, plus ``-kl_coef * (log pi - log pi_ref)`` a step.

Departures from TorchRL: eos and pad ids from the caller, tokenizer or model config
(not GPT-2's 50256); sample log-probs and the log-ratio under the same temperature-scaled
distribution; no loop over rows and step-wise views only on request (linear memory); ``done``
once per row, searched in the response only; the reward model sees the eos token; the KL
history holds per-sequence summed log-ratios. Why, point by point: ``docs/design.md``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import Tensor, nn

from tether.models.sampling import sample_responses
from tether.models.scoring import score_tokens
from tether.ops.checks import kl_coefficient, real_number, whole_number
from tether.ops.masks import rows_to_padded
from tether.rollout._checks import check_generated, per_step
from tether.rollout.prompts import PromptBatch
from tether.models.special_ids import resolve_eos_ids, resolve_pad_id
from tether.rollout.steps import EpisodeEnds, StepViews, episode_ends, stepwise_views

__all__ = ["Generation", "RolloutFromModel"]


@dataclass(frozen=True)
class Generation:
    """What ``RolloutFromModel.generate`` returns.

    Unpacks like TorchRL's triple: ``generated, log_probs, log_ratio = rollout.generate(b)``.

    Attributes:
        generated: ``long [B, L + N]``, right-padded: prompt at ``[0, prompt_rindex)``,
            response at ``[prompt_rindex, prompt_rindex + N)``, pad after the response end.
        log_probs: ``float32 [B, N, 1]`` (TorchRL's layout), log-prob of each sampled
            token under ``softmax(logits / temperature)`` as recorded while sampling; 0
            after the end.
        log_ratio: ``float [B, N]`` (float32, or float64 for float64 models),
            ``log pi - log pi_ref`` of each generated token, both recomputed on the full
            sequence at the sampling temperature; 0 after the end.
        response_mask: ``bool [B, N]``, True on the generated tokens (eos included).
        policy_log_probs: ``float [B, N]``, the policy term of ``log_ratio``.
        ref_log_probs: ``float [B, N]``, the reference term of ``log_ratio``.
    """

    generated: Tensor
    log_probs: Tensor
    log_ratio: Tensor
    response_mask: Tensor
    policy_log_probs: Tensor
    ref_log_probs: Tensor

    def __iter__(self):
        return iter((self.generated, self.log_probs, self.log_ratio))


class RolloutFromModel:
    """Rollouts of a causal LM against a frozen reference and a reward model.

    Args:
        model: the policy, a Hugging Face causal LM (keep it in eval mode: dropout would
            make the recomputed log-probs differ from the sampled ones).
        ref_model: the frozen reference causal LM (same vocabulary).
        reward_model: called as ``reward_model(input_ids=..., attention_mask=...)`` on
            right-padded ``[B, T]`` batches; returns an object with ``end_scores [B]``
            (``tether.models.SequenceRewardModel``) or a ``(token_scores, end_scores)`` pair.
        kl_coef: initial coefficient of the per-token KL penalty (>= 0).
        max_new_tokens: ``N``, the response length limit and the episode length.
        score_clip: reward-model score differences are clipped to ``[-score_clip, score_clip]``.
        kl_scheduler: optional controller (``tether.control``) driven by ``step_scheduler``.
        num_steps: keep the KL of at most this many rollouts for the scheduler (None: all
            since the last ``step_scheduler``).
        temperature: sampling temperature; also the temperature of every log-prob.
        tokenizer: source of the eos/pad ids when they are not passed.
        eos_token_id: int or list of ints ending a response.
        pad_token_id: id written after a response ends.
        generator: torch RNG for reproducible sampling.
        materialize_steps: also write TorchRL's step-wise ``input_ids`` / ``attention_mask``
            (and their ``"next"`` twins), ``[B, N, L + N]`` each. Off by default: they cost
            ``O(B * N * (L + N))``; ``stepwise_views(td)`` builds them on demand.

    Examples:
        >>> import torch
        >>> from tether.models import frozen_copy
        >>> from tether.models.tiny import byte_tokenizer, tiny_causal_lm
        >>> from tether.rollout import PromptBatch
        >>> tok = byte_tokenizer()
        >>> policy = tiny_causal_lm(tok)
        >>> def score(input_ids, attention_mask):  # a stand-in reward model: 0.1 per token
        ...     return None, 0.1 * attention_mask.sum(-1).float()
        >>> rollout = RolloutFromModel(policy, frozen_copy(policy), score, max_new_tokens=4, tokenizer=tok,
        ...                            generator=torch.Generator().manual_seed(0))
        >>> ids = torch.tensor([tok("2+2=").input_ids, tok("1+3=").input_ids])
        >>> td = rollout.rollout_from_data(PromptBatch.from_tensors(ids, torch.ones_like(ids, dtype=torch.bool),
        ...                                                         torch.tensor([4, 4])))
        >>> td.batch_size  # [B, N]: one step per new token
        torch.Size([2, 4])
        >>> # The score of prompt + answer minus the prompt's own, 0.1 * 4 new tokens, at the last step;
        >>> # the reference is the policy, so the KL part is 0.
        >>> td["next", "reward"].squeeze(-1)
        tensor([[0.0000, 0.0000, 0.0000, 0.4000],
                [0.0000, 0.0000, 0.0000, 0.4000]])
    """

    def __init__(
        self,
        model: nn.Module,
        ref_model: nn.Module,
        reward_model: Any,
        kl_coef: float = 0.1,
        max_new_tokens: int = 50,
        score_clip: float = 10.0,
        kl_scheduler: Any = None,
        num_steps: int | None = None,
        *,
        temperature: float = 1.0,
        tokenizer: Any = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        materialize_steps: bool = False,
    ) -> None:
        for name, module in (("model", model), ("ref_model", ref_model)):
            if not isinstance(module, nn.Module):
                raise TypeError(f"{name}: expected a Hugging Face causal LM (nn.Module), got {type(module).__name__}.")
        if not callable(reward_model):
            raise TypeError(f"reward_model: expected a callable model, got {type(reward_model).__name__}.")
        if kl_scheduler is not None and not callable(getattr(kl_scheduler, "update", None)):
            raise TypeError(
                f"kl_scheduler: expected a KL controller with an update(kl_values) method, got "
                f"{type(kl_scheduler).__name__}. Pass e.g. tether.control.AdaptiveKLController."
            )
        self.model = model
        self.ref_model = ref_model
        self.reward_model = reward_model
        self.kl_coef = kl_coef
        self.max_new_tokens = whole_number("max_new_tokens", max_new_tokens, low=1)
        self.score_clip = real_number("score_clip", score_clip, low=0, low_open=True, allow_inf=True)
        self.temperature = real_number("temperature", temperature, low=0, low_open=True)
        self.kl_scheduler = kl_scheduler
        self.num_steps = None if num_steps is None else whole_number("num_steps", num_steps, low=1)
        self.eos_token_ids = resolve_eos_ids(eos_token_id, model, tokenizer)
        self.pad_token_id = resolve_pad_id(pad_token_id, model, tokenizer)
        self.generator = generator
        self.materialize_steps = bool(materialize_steps)
        # One [B] tensor of per-sequence KLs per rollout; maxlen None keeps all of them.
        self._kl_queue: collections.deque[Tensor] = collections.deque(maxlen=self.num_steps)

    # ------------------------------------------------------------------ coefficient
    @property
    def kl_coef(self) -> float:
        """Coefficient of the per-token KL penalty; a controller may write it."""
        return self._kl_coef

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        self._kl_coef = kl_coefficient("kl_coef", value)

    # ------------------------------------------------------------------ rollouts
    @torch.no_grad()
    def rollout_from_data(self, batch: PromptBatch) -> TensorDict:
        """Sample responses for ``batch`` and return the rollout TensorDict ``[B, N]``."""
        generation = self.generate(batch)
        return self.create_rollout_td(batch, *generation)

    @torch.no_grad()
    def generate(self, batch: PromptBatch) -> Generation:
        """Sample one response per prompt and the log-probs the rollout needs.

        Args:
            batch: ``PromptBatch``; anything after ``prompt_rindex`` (a reference
                completion) is ignored here.

        Returns:
            ``Generation`` (unpacks as ``generated, log_probs, log_ratio``).
        """
        batch = self._checked(batch, _device_of(self.model))
        num_new = self.max_new_tokens
        prompt_ids, prompt_mask = self._left_padded_prompt(batch)
        sample = sample_responses(
            self.model,
            prompt_ids,
            prompt_mask,
            max_new_tokens=num_new,
            eos_ids=self.eos_token_ids,
            pad_id=self.pad_token_id,
            temperature=self.temperature,
            generator=self.generator,
        )
        missing = num_new - sample.tokens.shape[-1]
        tokens = F.pad(sample.tokens, (0, missing), value=self.pad_token_id)
        response_mask = F.pad(sample.mask, (0, missing), value=False)
        log_probs = F.pad(sample.log_probs, (0, missing), value=0.0)
        rindex = batch.prompt_rindex
        index = rindex[:, None] + torch.arange(num_new, device=rindex.device)
        prompt_only = batch.mask_label(self.pad_token_id).input_ids
        generated = F.pad(prompt_only, (0, num_new), value=self.pad_token_id).scatter(1, index, tokens)
        positions = torch.arange(generated.shape[-1], device=generated.device)
        sequence_mask = positions < (rindex + response_mask.sum(-1))[:, None]
        policy = self._response_log_probs(self.model, generated, sequence_mask, index)
        reference = self._response_log_probs(self.ref_model, generated, sequence_mask, index)
        return Generation(
            generated=generated,
            log_probs=log_probs[..., None],
            log_ratio=(policy - reference).masked_fill(~response_mask, 0.0),
            response_mask=response_mask,
            policy_log_probs=policy,
            ref_log_probs=reference,
        )

    @torch.no_grad()
    def create_rollout_td(
        self, batch: PromptBatch, generated: Tensor, log_probs: Tensor, log_ratio: Tensor
    ) -> TensorDict:
        """Lay a generated batch out as ``[B, N]`` episodes with rewards and done flags.

        Args:
            batch: the ``PromptBatch`` the responses were sampled for.
            generated: ``long [B, L + N]`` from ``generate``.
            log_probs: ``[B, N]`` (or ``[B, N, 1]``) sample log-probs.
            log_ratio: ``[B, N]`` (or ``[B, N, 1]``) policy/reference log-ratios.

        Returns:
            ``TensorDict`` of batch size ``[B, N]`` (time dim named ``"time"``) with
            ``action`` ``long [B, N]``; ``sample_log_prob`` ``float`` in the layout of
            ``log_probs`` (``[B, N, 1]`` from ``generate``, ``[B, N]`` if so given; 0 after the
            end); ``step_mask`` ``bool [B, N]`` (steps up to and including ``done``);
            ``sequence`` ``long [B, N, L + N]``, the final sequence as a stride-0 view (one
            copy in memory); ``length`` / ``("next", "length")`` ``long [B, N]``, the
            number of tokens visible before / after each step; ``("next", key)`` for
            ``reward``, ``reward_raw``, ``reward_kl`` (``float [B, N, 1]``) and ``done``,
            ``terminated``, ``truncated`` (``bool [B, N, 1]``). With
            ``materialize_steps`` also ``input_ids``, ``attention_mask`` and their
            ``"next"`` twins, ``[B, N, L + N]``.
        """
        batch = self._checked(batch, generated.device if isinstance(generated, Tensor) else None)
        size, width = batch.input_ids.shape
        num_new = self.max_new_tokens
        check_generated(generated, size, width + num_new)
        given = log_probs  # its layout, [B, N] or [B, N, 1], is the one sample_log_prob keeps
        log_probs = per_step("log_probs", log_probs, size, num_new)
        log_ratio = per_step("log_ratio", log_ratio, size, num_new)
        rindex = batch.prompt_rindex
        steps = torch.arange(num_new, device=generated.device)
        action = generated.gather(1, rindex[:, None] + steps)
        ends = episode_ends(action, self.eos_token_ids)
        positions = torch.arange(generated.shape[-1], device=generated.device)
        sequence_mask = positions < (rindex + ends.num_tokens)[:, None]
        sequence = generated.masked_fill(~sequence_mask, self.pad_token_id)
        kl = log_ratio.float().masked_fill(~ends.step_mask, 0.0)
        td = TensorDict(
            {
                "action": action,
                "sample_log_prob": self._sample_log_prob(log_probs, given, ends.step_mask),
                "step_mask": ends.step_mask,
                "sequence": sequence[:, None, :].expand(size, num_new, sequence.shape[-1]),
                "length": rindex[:, None] + torch.minimum(steps, ends.num_tokens[:, None]),
                "next": self._next_entries(batch, sequence, sequence_mask, ends, kl),
            },
            batch_size=[size, num_new],
            device=generated.device,
        )
        if self.materialize_steps:
            self._write_steps(td)
        self._kl_queue.append(kl.sum(-1).detach().to("cpu", torch.float64))
        return td.refine_names(..., "time")

    @staticmethod
    def _sample_log_prob(log_probs: Tensor, given: Tensor, step_mask: Tensor) -> Tensor:
        """``log_probs [B, N]`` zeroed after the end, in the layout of ``given``.

        TorchRL stores what it is given: ``generate``'s ``[B, N, 1]``, or ``[B, N]`` from a
        caller's own scores (TorchRL's scores with ``use_max=True`` are ``[B, N]``).
        """
        kept = log_probs.float().masked_fill(~step_mask, 0.0)
        return kept if given.dim() == 2 else kept[..., None]

    def _next_entries(self, batch: PromptBatch, sequence: Tensor, sequence_mask: Tensor, ends: EpisodeEnds,
                      kl: Tensor) -> dict[str, Tensor]:
        """The ``("next", ...)`` entries of each step: visible length, done flags and rewards.

        ``kl`` is the ``[B, N]`` per-step log-ratio, 0 after the end; the clipped score is paid
        at the done step only.
        """
        steps = torch.arange(kl.shape[-1], device=kl.device)
        done, terminated, truncated = ends.done_flags()
        reward_raw = torch.where(done, self._clipped_score(batch, sequence, sequence_mask)[:, None, None], 0.0)
        reward_kl = -self.kl_coef * kl[..., None]
        return {
            "length": batch.prompt_rindex[:, None] + torch.minimum(steps + 1, ends.num_tokens[:, None]),
            "done": done,
            "terminated": terminated,
            "truncated": truncated,
            "reward": reward_raw + reward_kl,
            "reward_raw": reward_raw,
            "reward_kl": reward_kl,
        }

    def stepwise_views(self, td: TensorDict) -> StepViews:
        """The seed's per-step ``input_ids`` / ``attention_mask`` (and ``next`` ones) of ``td``."""
        return stepwise_views(td, self.pad_token_id)

    # ------------------------------------------------------------------ KL control
    @property
    def queued_kl(self) -> Tensor:
        """``float64 [n]``: per-sequence summed KLs waiting for ``step_scheduler``."""
        if not self._kl_queue:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat(list(self._kl_queue))

    def step_scheduler(self) -> float:
        """Feed the queued per-sequence KLs to ``kl_scheduler``, adopt its coefficient.

        The controller receives one summed KL per sequence (nats per sequence) and counts
        sequences as its steps. The queue is emptied. Returns the new ``kl_coef``.
        """
        if self.kl_scheduler is None:
            raise ValueError(
                "kl_scheduler: step_scheduler() needs a KL controller, but RolloutFromModel was "
                "built with kl_scheduler=None. Pass kl_scheduler=AdaptiveKLController(...) "
                "(tether.control) or set rollout.kl_scheduler."
            )
        if not self._kl_queue:
            raise ValueError(
                "step_scheduler: no KL recorded since the last update; call rollout_from_data "
                "(or create_rollout_td) at least once before stepping the scheduler."
            )
        self.kl_coef = self.kl_scheduler.update(self.queued_kl)
        self._kl_queue.clear()
        return self.kl_coef

    # ------------------------------------------------------------------ internals
    def _checked(self, batch: Any, device: torch.device | None) -> PromptBatch:
        if not isinstance(batch, PromptBatch):
            raise TypeError(
                f"batch: expected a tether.rollout.PromptBatch, got {type(batch).__name__}. "
                "Build one with PromptBatch.from_tensors(input_ids, attention_mask, prompt_rindex)."
            )
        batch = batch.validate()
        return batch if device is None else batch.to(device)

    def _left_padded_prompt(self, batch: PromptBatch) -> tuple[Tensor, Tensor]:
        """The prompts moved to the left, trimmed to the longest: ``[B, P]`` ids and mask."""
        rindex = batch.prompt_rindex
        rows, span = batch.input_ids.shape
        first = torch.arange(rows, device=rindex.device) * span  # each prompt starts its row
        prompt = rows_to_padded(batch.input_ids.reshape(-1), first, rindex, int(rindex.max()), padding_side="left",
                                padding_value=self.pad_token_id)
        return prompt.values, prompt.mask

    def _response_log_probs(self, model: nn.Module, generated: Tensor, mask: Tensor, index: Tensor) -> Tensor:
        stats = score_tokens(model, generated, mask, temperature=self.temperature)
        return stats.log_probs.to(generated.device).gather(1, index)

    def _clipped_score(self, batch: PromptBatch, sequence: Tensor, sequence_mask: Tensor) -> Tensor:
        """``[B]``: score of the finished sequence minus the reference's, clipped."""
        reference = batch.reference_view()
        score = self._end_scores(sequence, sequence_mask)
        baseline = self._end_scores(reference.input_ids, reference.attention_mask)
        return (score - baseline).clamp(-self.score_clip, self.score_clip)

    def _end_scores(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.reward_model(input_ids=input_ids, attention_mask=attention_mask)
        scores = getattr(out, "end_scores", None)
        if scores is None and isinstance(out, (tuple, list)) and len(out) == 2:
            scores = out[1]
        size = input_ids.shape[0]
        if not isinstance(scores, Tensor) or scores.numel() != size:
            raise TypeError(
                f"reward_model: expected an output with end_scores [{size}] (e.g. "
                f"tether.models.SequenceRewardModel) or a (token_scores, end_scores) pair, got "
                f"{type(out).__name__}. Wrap the classifier in SequenceRewardModel."
            )
        return scores.reshape(size).float().to(input_ids.device)

    def _write_steps(self, td: TensorDict) -> None:
        views = stepwise_views(td, self.pad_token_id)
        td.set("input_ids", views.input_ids)
        td.set("attention_mask", views.attention_mask)
        td.set(("next", "input_ids"), views.next_input_ids)
        td.set(("next", "attention_mask"), views.next_attention_mask)


def _device_of(model: nn.Module) -> torch.device | None:
    parameter = next(model.parameters(), None)
    return None if parameter is None else parameter.device
