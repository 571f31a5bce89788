"""LLM ``KLRewardTransform``: reference log-probs of a batch and a k1 KL penalty on its reward.

The policy's log-probs are read from the batch (``log_prob_key``, as recorded by the
sampler or a scorer); only the reference is run, through ``RetrieveLogProb``, and
``KLComputation`` writes ``reward - coef * (log pi - log pi_ref)`` per token.

Departures from TorchRL: TorchRL read the reward before its own ``None`` check
and crashed on a batch without one; here a missing reward with ``add_to_reward=True``
raises a ``KeyError`` that names the key and says to add a reward or pass
``add_to_reward=False`` (which writes only the KL and the reference log-probs). The
reference may use any input mode (TorchRL demanded ``"tokens"``): tokens already in the
batch are scored as they are. ``"kl_penalty"`` and ``"ref_log_prob"`` are ``[B, T]``
(jagged ``[B, j]``) like every per-token tensor in tether, not ``[B, T, 1]``. No Ray
metaclass: the Ray variant is a separate class in ``tether.ray``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey

from tether.llm.keys import SAMPLE_LOG_PROBS
from tether.llm._token_grid import ATTENTION_KEY, as_key, on_rows
from tether.llm.kl_computation import KLComputation
from tether.llm.retrieve_kl import resolve_reference
from tether.llm.retrieve_log_prob import RetrieveLogProb
from tether.models import TransformersWrapper

__all__ = ["KLRewardTransform"]

_EXTRA_OUT_KEYS = ("kl_penalty", "ref_log_prob")


def _key_list(name: str, keys: Any) -> list[NestedKey]:
    if isinstance(keys, list):
        return [as_key(f"{name}[{i}]", k) for i, k in enumerate(keys)]
    return [as_key(name, keys)]


def _resolve_keys(in_keys: Any, out_keys: Any) -> tuple[NestedKey, NestedKey, NestedKey, NestedKey]:
    """(reward in, reward out, kl, reference log-prob) from TorchRL's key conventions."""
    ins = _key_list("in_keys", "reward" if in_keys is None else in_keys)
    if len(ins) != 1:
        raise ValueError(f"in_keys: expected exactly one key (the reward), got {ins!r}.")
    outs = list(ins) if out_keys is None else _key_list("out_keys", out_keys)
    if len(outs) == 1:
        outs += list(_EXTRA_OUT_KEYS)
    if len(outs) != 3:
        raise ValueError(
            f"out_keys: expected one key (the adjusted reward) or three (reward, kl, reference "
            f"log-prob), got {outs!r}."
        )
    return ins[0], outs[0], outs[1], outs[2]


class KLRewardTransform(TensorDictModuleBase):
    """Charge ``coef * (log pi - log pi_ref)`` on the reward of an LLM batch.

    Args:
        ref_model: scoring ``TransformersWrapper`` of the frozen reference.

    Keyword Args:
        ref_model_factory: callable building ``ref_model`` (never together with it).
        coef: KL coefficient (>= 0); read/write as ``kl_coef`` (or ``coef``).
        in_keys: the reward key (default ``"reward"``), read from ``td["next"]`` when the
            batch has one, else from the root: ``[B, 1]`` per sequence or ``[B, T, 1]``.
        out_keys: ``[adjusted reward, kl, reference log-prob]``; default
            ``[in_key, "kl_penalty", "ref_log_prob"]``.
        log_prob_key: the policy's recorded log-probs ``[B, T]`` (or jagged).
        device: device of the reference log-probs (see ``RetrieveLogProb``).
        add_to_reward: False writes only the KL and the reference log-probs.
        tokenizer: tokenizer rendering chats for the reference (default its own).
        assistant_only: restrict the KL to the assistant mask (a tokens-mode reference, as
            TorchRL requires, reads it from the batch). With False every scored
            token counts, so the policy's log-probs must cover every token (from a scorer;
            sampling log-probs cover the response only).
        padding_side: layout of outputs the reference scorer lays out itself.

    Raises at call time a ``KeyError`` when the reward (with ``add_to_reward=True``) or the
    policy's log-probs are missing, naming the key and the keys present.

    Examples:
        >>> import torch
        >>> from tether.llm import KLRewardTransform, answer_sums, chat_batch
        >>> from tether.models import TransformersWrapper
        >>> from tether.models.tiny import byte_tokenizer, tiny_causal_lm
        >>> tok = byte_tokenizer()
        >>> sampler = TransformersWrapper(tiny_causal_lm(tok, seed=0), tok,
        ...                               generate_kwargs={"max_new_tokens": 4, "generator": torch.Generator().manual_seed(0)})
        >>> ref = TransformersWrapper(tiny_causal_lm(tok, seed=1), tok, input_mode="tokens", generate=False,
        ...                           log_probs_key="ref_log_probs")
        >>> batch = sampler(chat_batch([[{"role": "user", "content": "Hi"}]] * 2, key=("history", "prompt")))
        >>> batch["next", "reward"] = torch.tensor([[1.0], [0.0]])  # one reward per answer
        >>> batch = KLRewardTransform(ref, coef=0.1)(batch)  # per token: r - 0.1 * kl
        >>> batch["next", "reward"].shape == (*batch["tokens", "full"].shape, 1)
        True
        >>> returns = torch.tensor([1.0, 0.0]) - 0.1 * answer_sums(batch, ("next", "kl_penalty"))  # one per answer
    """

    def __init__(
        self,
        ref_model: TransformersWrapper | None = None,
        *,
        ref_model_factory: Callable[[], TransformersWrapper] | None = None,
        coef: float = 1.0,
        in_keys: Any = None,
        out_keys: Any = None,
        log_prob_key: NestedKey = SAMPLE_LOG_PROBS,
        device: torch.device | str | None = None,
        add_to_reward: bool = True,
        tokenizer: Any = None,
        assistant_only: bool = True,
        padding_side: str = "left",
    ) -> None:
        super().__init__()
        reference = resolve_reference(ref_model, ref_model_factory)
        reward_in, reward_out, kl_key, ref_key = _resolve_keys(in_keys, out_keys)
        self.ref_log_prob = RetrieveLogProb(
            reference, log_probs_full_key=ref_key, assistant_only=assistant_only,
            tokenizer=tokenizer, device=device, padding_side=padding_side,
        )
        self.kl_computation = KLComputation(
            log_prob_key, ref_key, kl_key=kl_key, add_to_reward=add_to_reward, coeff=coef,
            padding_side=padding_side, estimator="k1", reward_key=reward_in,
            out_reward_key=reward_out, mask_key=None if assistant_only else ATTENTION_KEY,
        )
        self.add_to_reward = bool(add_to_reward)
        self.log_prob_key = self.kl_computation.gen_log_probs_full_key
        self.in_keys = ([reward_in] if add_to_reward else []) + [self.log_prob_key] + list(self.ref_log_prob.in_keys)
        self.out_keys = ([reward_out] if add_to_reward else []) + [kl_key, ref_key]

    @property
    def kl_coef(self) -> float:
        return self.kl_computation.kl_coef

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        self.kl_computation.kl_coef = value

    coef = kl_coef  # TorchRL's keyword

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        return on_rows(td, self._forward)

    def _forward(self, td: TensorDictBase) -> TensorDictBase:
        # Fail on a missing reward or policy log-probs before running the reference.
        self.kl_computation.check_inputs(td, (self.log_prob_key,))
        return self.kl_computation(self.ref_log_prob(td))
