"""``KLComputation``: per-token KL between two recorded log-probs, charged on the reward.

For every token ``t`` the estimator (``k1`` by default, ``log pi - log pi_ref``) is taken
from ``tether.ops.kl_estimate`` and kept only where an explicit mask says the token counts:
the assistant mask if the batch has one, else the attention mask, else every stored
position. A log-prob equal to 0 is a value like any other, never a padding marker.

Departures from TorchRL: missing inputs raise a ``KeyError`` naming them and
listing the keys present (TorchRL raised ``AttributeError`` while formatting its own
message); the estimator is selectable; per-sequence rewards ``[B, 1]`` (or ``[B, 1, 1]``) are broadcast over
the tokens instead of being refused; the KL is written as ``[B, T]`` in the layout of the
log-probs rather than as a strided nested tensor; the coefficient is a read/write
``kl_coef`` so a controller can drive it; a NaN log-prob inside the mask raises a ``ValueError``
naming its key instead of reaching the adjusted reward.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import Tensor

from tether.llm.keys import REFERENCE_LOG_PROBS, SAMPLE_LOG_PROBS
from tether.llm._checks import check_estimator, check_padding_side
from tether.llm._token_grid import (
    ASSISTANT_KEY,
    ATTENTION_KEY,
    TokenGrid,
    as_key,
    find,
    on_rows,
    read_grid,
    read_mask,
    scopes_of,
)
from tether.models.batch_io import get_entry, missing_key
from tether.ops import kl_estimate, nested_to_padded
from tether.ops.checks import kl_coefficient

__all__ = ["KLComputation"]


def _check_aligned(gen: TokenGrid, ref: TokenGrid, keys: tuple[NestedKey, NestedKey]) -> None:
    if gen.nested != ref.nested:
        raise ValueError(
            f"{keys[0]!r} is {'nested' if gen.nested else 'padded'} but {keys[1]!r} is "
            f"{'nested' if ref.nested else 'padded'}; build the policy and reference scorers "
            "with the same pad_output."
        )
    same = gen.values.shape == ref.values.shape and (not gen.nested or torch.equal(gen.valid, ref.valid))
    if gen.values.dim() != 2 or not same:
        detail = (
            f"row lengths {gen.valid.sum(-1).tolist()} and {ref.valid.sum(-1).tolist()}"
            if gen.nested else f"shapes {tuple(gen.values.shape)} and {tuple(ref.values.shape)}"
        )
        raise ValueError(
            f"{keys[0]!r} and {keys[1]!r} must hold one log-prob per token of the same "
            f"[B, T] tokens; got {detail} ({keys[0]!r} first). Score both from the same ('tokens', 'full'): "
            "scorers with input_mode='tokens' read it as sampled, while a 'history' or 'text' scorer renders its "
            "own (and a tokenizer whose pad == eos may drop the final eos from one of them)."
        )


def _check_no_nan(values: Tensor, mask: Tensor, key: NestedKey) -> None:
    """Refuse NaN log-probs where the KL counts: they would reach the adjusted reward unseen."""
    bad = mask & values.isnan()
    if bool(bad.any()):
        row, position = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{key!r}: expected log-probs that are not NaN inside the KL mask, got {int(bad.sum())} NaN (the "
            f"first at row {row}, position {position}). NaN outside the mask is ignored; find what wrote NaN "
            "there (a non-finite logit in the scoring forward)."
        )


class KLComputation(TensorDictModuleBase):
    """Per-token KL between two log-prob entries, optionally subtracted from the reward.

    Args:
        gen_log_probs_full_key: log-probs of the policy ``[B, T]`` (or jagged ``[B, j]``).
        ref_log_probs_full_key: log-probs of the reference, aligned with the policy's.

    Keyword Args:
        kl_key: where the per-token KL goes, ``[B, T]`` (or ``[B, j]``), 0 outside the mask.
        add_to_reward: write ``reward - coeff * kl`` over the reward.
        coeff: KL coefficient (>= 0); read/write as ``coeff`` or ``kl_coef``.
        padding_side: accepted for TorchRL's signature; outputs always keep the layout of
            the log-probs (nothing is re-padded here), so it has no effect.
        estimator: one of ``tether.ops.KL_ESTIMATORS`` (``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``).
        reward_key: the reward read from the output scope, ``[B, 1]`` (or ``[B, 1, 1]``) per sequence or
            ``[B, T, 1]`` (jagged ``[B, j, 1]``) per token.
        out_reward_key: where the adjusted reward goes; default ``reward_key``.
        mask_key: the mask selecting the tokens whose KL counts; default the assistant mask
            when present, else the attention mask, else every stored position.

    Inputs are looked up in ``td["next"]`` (when the TensorDict has one), then at its root;
    outputs go to ``td["next"]``, or to the root when there is no ``"next"``. Padded
    log-probs are taken to be laid out like ``("masks", "all_attention_mask")``.

    A per-sequence reward is copied onto every valid token (0 on padding), so the adjusted
    reward is ``[B, T, 1]`` in both cases: ``r_b - coeff * kl_{b,t}``. A missing reward
    with ``add_to_reward=True`` raises a ``KeyError``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tether.llm import KLComputation
        >>> td = TensorDict({("log_probs", "full"): torch.tensor([[0.0, -1.0, -2.0]]),
        ...                  ("ref_log_probs", "full"): torch.tensor([[0.0, -1.5, -1.0]]),
        ...                  ("masks", "all_assistant_mask"): torch.tensor([[False, True, True]]),
        ...                  ("next", "reward"): torch.tensor([[1.0]])}, [1])
        >>> out = KLComputation(coeff=0.1)(td)  # outputs go to "next" when the batch has one
        >>> out["next", "kl_penalty"]  # k1 = log pi - log pi_ref on the assistant tokens
        tensor([[ 0.0000,  0.5000, -1.0000]])
        >>> out["next", "reward"].squeeze(-1)  # 1 - 0.1 * kl, the reward copied onto every token
        tensor([[1.0000, 0.9500, 1.1000]])
    """

    def __init__(
        self,
        gen_log_probs_full_key: NestedKey = SAMPLE_LOG_PROBS,
        ref_log_probs_full_key: NestedKey = REFERENCE_LOG_PROBS,
        *,
        kl_key: NestedKey = "kl_penalty",
        add_to_reward: bool = True,
        coeff: float = 1.0,
        padding_side: str = "left",
        estimator: str = "k1",
        reward_key: NestedKey = "reward",
        out_reward_key: NestedKey | None = None,
        mask_key: NestedKey | None = None,
    ) -> None:
        super().__init__()
        self.gen_log_probs_full_key = as_key("gen_log_probs_full_key", gen_log_probs_full_key)
        self.ref_log_probs_full_key = as_key("ref_log_probs_full_key", ref_log_probs_full_key)
        if self.gen_log_probs_full_key == self.ref_log_probs_full_key:
            raise ValueError(
                f"gen_log_probs_full_key and ref_log_probs_full_key are both "
                f"{self.gen_log_probs_full_key!r}; expected two different entries."
            )
        self.kl_key = as_key("kl_key", kl_key)
        self.add_to_reward = bool(add_to_reward)
        self.kl_coef = coeff
        self.padding_side = check_padding_side(padding_side)
        self.estimator = check_estimator(estimator)
        self.reward_key = as_key("reward_key", reward_key)
        self.out_reward_key = as_key("out_reward_key", out_reward_key or reward_key)
        self.mask_key = None if mask_key is None else as_key("mask_key", mask_key)
        self.in_keys = [self.gen_log_probs_full_key, self.ref_log_probs_full_key] + (
            [self.reward_key] if self.add_to_reward else []
        )
        self.out_keys = [self.kl_key] + ([self.out_reward_key] if self.add_to_reward else [])

    @property
    def kl_coef(self) -> float:
        return self._coeff

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        self._coeff = kl_coefficient("kl_coef", value)

    coeff = kl_coef  # TorchRL's keyword

    def check_inputs(self, tensordict: TensorDictBase, log_prob_keys: tuple[NestedKey, ...] | None = None) -> None:
        """Raise the ``KeyError`` ``forward`` would raise for a missing reward or log-probs.

        Lets a composite fail before running a model. ``log_prob_keys`` limits the
        log-prob keys checked (default both).
        """
        scopes = scopes_of(tensordict)
        if log_prob_keys is None:
            log_prob_keys = (self.gen_log_probs_full_key, self.ref_log_probs_full_key)
        missing = [key for key in log_prob_keys if find(scopes, key) is None]
        if missing:
            raise missing_key(scopes, missing, "Run RetrieveLogProb (or a generating wrapper) first.")
        if self.add_to_reward and find(scopes[:1], self.reward_key) is None:
            raise missing_key(
                scopes[:1], [self.reward_key],
                "add_to_reward=True needs a reward ([B, 1] per sequence or [B, T, 1] per token) "
                "from the environment or a reward model; add it, or pass add_to_reward=False to "
                "only write the KL.",
            )

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        return on_rows(td, self._forward)

    def _forward(self, td: TensorDictBase) -> TensorDictBase:
        self.check_inputs(td)
        scopes = scopes_of(td)
        keys = (self.gen_log_probs_full_key, self.ref_log_probs_full_key)
        found = [find(scopes, key) for key in keys]
        gen = self._read(scopes, found[0], keys[0])
        ref = self._read(scopes, found[1], keys[1])
        _check_aligned(gen, ref, keys)
        mask = self._kl_mask(scopes, gen)
        ref_values = ref.values.to(gen.values.device)
        _check_no_nan(gen.values, mask, keys[0])
        _check_no_nan(ref_values, mask, keys[1])
        kl = torch.where(mask, kl_estimate(gen.values, ref_values, self.estimator), 0.0)
        target = scopes[0]
        target.set(self.kl_key, gen.restore(kl))
        if self.add_to_reward:
            reward = self._reward_grid(target, gen)
            target.set(self.out_reward_key, gen.restore(reward - self._coeff * kl.unsqueeze(-1)))
        return td

    @staticmethod
    def _read(scopes: tuple[TensorDictBase, ...], scope: TensorDictBase, key: NestedKey) -> TokenGrid:
        value = get_entry(scope, key)
        if not isinstance(value, Tensor) or value.is_nested:
            return read_grid(scope, key)
        mask_scope = find(scopes, ATTENTION_KEY)
        mask = None if mask_scope is None else get_entry(mask_scope, ATTENTION_KEY)
        if mask is not None and (mask.is_nested or mask.shape != value.shape[:2]):
            raise ValueError(
                f"{ATTENTION_KEY!r}: expected a padded mask of shape {tuple(value.shape[:2])} "
                f"laid out like {key!r}, got "
                f"{'a nested mask' if mask.is_nested else tuple(mask.shape)}. Write the "
                "log-probs and the tokens with the same pad_output and padding side."
            )
        return read_grid(scope, key, None if mask is None else mask.bool())

    def _kl_mask(self, scopes: tuple[TensorDictBase, ...], gen: TokenGrid) -> Tensor:
        if self.mask_key is not None:
            mask = read_mask(scopes, self.mask_key, gen)
            if mask is None:
                raise missing_key(scopes, [self.mask_key], "Add the mask or leave mask_key=None.")
            return mask & gen.valid
        for key in (ASSISTANT_KEY, ATTENTION_KEY):
            mask = read_mask(scopes, key, gen)
            if mask is not None:
                return mask & gen.valid
        return gen.valid

    def _reward_grid(self, target: TensorDictBase, gen: TokenGrid) -> Tensor:
        """The reward as ``[B, T, 1]`` aligned with the log-probs."""
        reward = get_entry(target, self.reward_key)
        batch, width = gen.valid.shape
        if reward.is_nested:
            if not gen.nested:
                raise ValueError(
                    f"{self.reward_key!r}: a nested per-token reward needs nested log-probs; "
                    "store the reward padded like the log-probs, or per sequence as [B, 1]."
                )
            padded = nested_to_padded(reward, padding_side="right")
            if padded.values.dim() != 3 or not torch.equal(padded.mask, gen.valid):
                raise ValueError(
                    f"{self.reward_key!r}: expected a jagged per-token reward [B, j, 1] with the "
                    f"log-probs' row lengths {gen.valid.sum(-1).tolist()}, got row lengths "
                    f"{padded.mask.sum(-1).tolist()} and {padded.values.dim()} dims."
                )
            return padded.values.to(gen.values.device)
        reward = reward.to(gen.values.device)
        if reward.shape in ((batch, 1), (batch, 1, 1)):
            return torch.where(gen.valid[..., None], reward.reshape(batch, 1, 1), 0.0)
        if reward.shape == (batch, width, 1) and not gen.nested:
            return reward
        expected = "[B, 1] / [B, 1, 1] per sequence or [B, j, 1] (jagged) per token"
        if not gen.nested:
            expected = (
                f"{[batch, 1]} or {[batch, 1, 1]} per sequence, or {[batch, width, 1]} per token "
                "(one entry per position of the log-probs)"
            )
        raise ValueError(
            f"{self.reward_key!r}: expected a reward of shape {expected}, got {list(reward.shape)}. "
            "Give one reward per sequence, or one per token laid out like the log-probs."
        )

    def extra_repr(self) -> str:
        return (
            f"gen={self.gen_log_probs_full_key!r}, ref={self.ref_log_probs_full_key!r}, "
            f"kl_key={self.kl_key!r}, estimator={self.estimator!r}, kl_coef={self._coeff}, "
            f"add_to_reward={self.add_to_reward}"
        )
