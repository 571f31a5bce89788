"""``RetrieveKL``: policy and reference log-probs of a batch, then their per-token KL.

A plain module that runs ``RetrieveLogProb(gen_model)`` (skipped when ``gen_model`` is None),
``RetrieveLogProb(ref_model)`` and ``KLComputation``, in that order; the first scorer that
renders chats writes the tokens and masks, so the second scores the very same ids.

``gen_model=None`` reuses the log-probs recorded at sampling time and saves one policy forward;
that equals a recomputation up to float32 rounding only under the conditions listed in the
docs (``docs/design.md``: same weights, same temperature, the sampled tokens still in the
batch, KL on the sampled tokens only).

Departures from TorchRL: no metaclass and no lazy ``"from_collector"`` policy;
``ref_model`` and ``ref_model_factory`` together are refused; the two scorers are checked
for matching layout, vocabulary and temperature; the estimator is selectable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from tether.llm.keys import REFERENCE_LOG_PROBS, SAMPLE_LOG_PROBS
from tether.llm._checks import check_pair, check_scorer, check_tokenizers
from tether.llm._token_grid import as_key, on_rows
from tether.llm.kl_computation import KLComputation
from tether.llm.retrieve_log_prob import RetrieveLogProb
from tether.models import TransformersWrapper

__all__ = ["RetrieveKL", "resolve_reference"]


def resolve_reference(
    ref_model: TransformersWrapper | None,
    ref_model_factory: Callable[[], TransformersWrapper] | None,
) -> TransformersWrapper:
    """The reference scorer from exactly one of ``ref_model`` and ``ref_model_factory``."""
    if ref_model_factory is not None and ref_model is not None:
        raise ValueError(
            "ref_model and ref_model_factory were both given; expected exactly one. Pass the "
            "wrapper, or a factory that builds it (useful where the model must be built remotely)."
        )
    if ref_model_factory is not None:
        if isinstance(ref_model_factory, nn.Module) or not callable(ref_model_factory):
            raise TypeError(
                f"ref_model_factory: expected a callable returning a TransformersWrapper, got "
                f"{type(ref_model_factory).__name__}. Pass a built wrapper as ref_model instead."
            )
        ref_model = ref_model_factory()
    if ref_model is None:
        raise ValueError(
            "ref_model: expected a scoring TransformersWrapper of the reference model (or a "
            "ref_model_factory), got None. Build one with TransformersWrapper(frozen_copy(model), "
            "tokenizer, generate=False, log_probs_key='ref_log_probs')."
        )
    return check_scorer(ref_model, "ref_model")


class RetrieveKL(TensorDictModuleBase):
    """Per-token KL(policy || reference) of a batch, optionally charged on its reward.

    Args:
        gen_model: scoring wrapper of the policy, or None to reuse the log-probs recorded
            while sampling (see the module docstring for when that is exact).
        ref_model: scoring wrapper of the frozen reference.

    Keyword Args:
        ref_model_factory: callable building ``ref_model`` (never together with it).
        assistant_only, tokenizer_kwargs, detach, device, tokenizer, padding_side: passed
            to both ``RetrieveLogProb`` (see there). With ``assistant_only=False`` the KL
            counts every scored token instead of the assistant tokens.
        gen_log_probs_full_key, ref_log_probs_full_key: where the two log-probs live.
        kl_key, add_to_reward, coeff, estimator: passed to ``KLComputation``.

    Attributes:
        gen_log_prob: the policy's ``RetrieveLogProb`` (None when reusing).
        ref_log_prob: the reference's ``RetrieveLogProb``.
        kl_computation: the ``KLComputation``; ``kl_coef`` reads and writes its coefficient.

    Examples:
        >>> import torch
        >>> from tether.llm import RetrieveKL, chat_batch
        >>> from tether.models import TransformersWrapper
        >>> from tether.models.tiny import byte_tokenizer, tiny_causal_lm
        >>> tok = byte_tokenizer()
        >>> policy = TransformersWrapper(tiny_causal_lm(tok, seed=0), tok, generate=False)
        >>> ref = TransformersWrapper(tiny_causal_lm(tok, seed=1), tok, generate=False, log_probs_key="ref_log_probs")
        >>> batch = chat_batch([[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]])
        >>> out = RetrieveKL(policy, ref, add_to_reward=False)(batch)  # no reward yet: only the KL
        >>> mask = out["masks", "all_assistant_mask"]
        >>> torch.equal(out["kl_penalty"], (out["log_probs", "full"] - out["ref_log_probs", "full"]) * mask)
        True
    """

    def __init__(
        self,
        gen_model: TransformersWrapper | None = None,
        ref_model: TransformersWrapper | None = None,
        *,
        ref_model_factory: Callable[[], TransformersWrapper] | None = None,
        assistant_only: bool = True,
        tokenizer_kwargs: Mapping[str, Any] | None = None,
        detach: bool = True,
        device: torch.device | str | None = None,
        tokenizer: Any = None,
        padding_side: str = "left",
        gen_log_probs_full_key: NestedKey = SAMPLE_LOG_PROBS,
        ref_log_probs_full_key: NestedKey = REFERENCE_LOG_PROBS,
        kl_key: NestedKey = "kl_penalty",
        add_to_reward: bool = True,
        coeff: float = 1.0,
        estimator: str = "k1",
    ) -> None:
        super().__init__()
        ref_model = resolve_reference(ref_model, ref_model_factory)
        if gen_model is not None:
            check_pair(check_scorer(gen_model, "gen_model"), ref_model)
        elif not assistant_only:
            raise ValueError(
                "assistant_only=False with gen_model=None: sampling log-probs exist only for the "
                "sampled response (prompt positions hold 0, not a log-prob), so the KL must be "
                "restricted to the assistant mask. Keep assistant_only=True or pass a gen_model."
            )
        if tokenizer is not None:
            check_tokenizers(tokenizer, ref_model.tokenizer, ("tokenizer", "ref_model.tokenizer"))
        gen_key = as_key("gen_log_probs_full_key", gen_log_probs_full_key)
        ref_key = as_key("ref_log_probs_full_key", ref_log_probs_full_key)
        # Both scorers see the same chat rendering, layout and detaching.
        shared = {
            "tokenizer": tokenizer,
            "tokenizer_kwargs": tokenizer_kwargs,
            "assistant_only": assistant_only,
            "padding_side": padding_side,
            "detach": detach,
            "device": device,
        }
        self.gen_log_prob = (
            None if gen_model is None else RetrieveLogProb(gen_model, log_probs_full_key=gen_key, **shared)
        )
        self.ref_log_prob = RetrieveLogProb(ref_model, log_probs_full_key=ref_key, **shared)
        self.kl_computation = KLComputation(
            gen_key, ref_key, kl_key=kl_key, add_to_reward=add_to_reward, coeff=coeff,
            padding_side=padding_side, estimator=estimator,
            mask_key=None if assistant_only else ("masks", "all_attention_mask"),
        )
        inputs = list(self.ref_log_prob.in_keys) + ([gen_key] if gen_model is None else [])
        self.in_keys = inputs + ([self.kl_computation.reward_key] if add_to_reward else [])
        self.out_keys = ([gen_key] if gen_model is not None else []) + [ref_key] + list(self.kl_computation.out_keys)

    @property
    def kl_coef(self) -> float:
        return self.kl_computation.kl_coef

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        self.kl_computation.kl_coef = value

    coeff = kl_coef  # TorchRL's keyword

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        return on_rows(td, self._forward)

    def _forward(self, td: TensorDictBase) -> TensorDictBase:
        # Fail on a missing reward (or missing sampling log-probs) before running a model.
        reused = () if self.gen_log_prob is not None else (self.kl_computation.gen_log_probs_full_key,)
        self.kl_computation.check_inputs(td, reused)
        if self.gen_log_prob is not None:
            td = self.gen_log_prob(td)
        td = self.ref_log_prob(td)
        return self.kl_computation(td)
