"""What ``GRPOLoss`` reads from a TensorDict: configurable keys and one aligned batch.

Every per-token entry is brought onto the grid of the tokens: padded entries must have the
tokens' ``[B, T]`` shape; jagged (nested) entries are placed at the valid positions of the
attention mask, row by row. The mask the loss trains on is always an explicit tensor
(``loss mask & attention mask``); a log-prob of 0 is a value, never a padding marker.
Values outside that mask are replaced by 0 so that NaN or inf padding (TorchRL stores NaN
there) can reach neither a result nor a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey
from torch import Tensor

from tether.models.batch_io import fetch, has_key, missing_key
from tether.models.records import StepRecord
from tether.ops import nested_to_padded
from tether.ops.checks import check_mask, check_same_device, check_token_ids
from tether.ops.masks import row_runs


@dataclass
class GRPOKeys:
    """TensorDict keys read by ``GRPOLoss`` (change them with ``GRPOLoss.set_keys``).

    Field names follow TorchRL's GRPO loss where it has one (``advantage``, ``action``,
    ``sample_log_prob``, ``ref_log_probs``).
    """

    advantage: NestedKey = "advantage"
    action: NestedKey = ("tokens", "full")
    attention_mask: NestedKey = ("masks", "all_attention_mask")
    loss_mask: NestedKey | None = ("masks", "all_assistant_mask")  # None: every predicted valid token
    sample_log_prob: NestedKey = ("log_probs", "full")
    ref_log_probs: NestedKey = ("ref_log_probs", "full")
    old_log_probs: NestedKey = ("old_log_probs", "full")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class GRPOBatch:
    """One batch on the token grid; every per-token tensor is ``[B, T]`` and 0 outside ``mask``."""

    tokens: Tensor  # long [B, T]
    attention_mask: Tensor  # bool [B, T]
    mask: Tensor  # bool [B, T]: tokens the loss trains on
    sample_log_probs: Tensor  # [B, T]
    advantage: Tensor  # [B, 1] or [B, T]
    ref_log_probs: Tensor | None
    old_log_probs: Tensor | None

    def to(self, device: torch.device, dtype: torch.dtype) -> GRPOBatch:
        """Float entries cast to ``dtype``; everything moved to ``device``."""

        def move(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.to(device=device, dtype=dtype)

        return GRPOBatch(
            tokens=self.tokens.to(device),
            attention_mask=self.attention_mask.to(device),
            mask=self.mask.to(device),
            sample_log_probs=move(self.sample_log_probs),
            advantage=move(self.advantage),
            ref_log_probs=move(self.ref_log_probs),
            old_log_probs=move(self.old_log_probs),
        )


def _fetch(td: TensorDictBase, key: NestedKey, what: str, fix: str = "") -> Tensor:
    value = fetch(td, key, what, fix)
    if not isinstance(value, Tensor):
        raise TypeError(f"{key!r}: expected {what} as a tensor, got {type(value).__name__}.")
    return value


def _squeeze_feature(value: Tensor) -> Tensor:
    return value.squeeze(-1) if value.dim() == 3 and value.shape[-1] == 1 else value


def _on_grid(value: Tensor, key: NestedKey, attention: Tensor, nested_tokens: bool,
             tokens_key: NestedKey = GRPOKeys.action) -> Tensor:
    """``value`` (padded ``[B, T(, 1)]`` or jagged ``[B, j(, 1)]``) on the ``[B, T]`` grid of the
    tokens under ``tokens_key`` (named in the errors, so each width says where it came from)."""
    if value.is_nested:
        padded = nested_to_padded(value, padding_side="right")
        rows = _squeeze_feature(padded.values)
        lengths, expected = padded.mask.sum(-1), attention.sum(-1).to(padded.mask.device)
        if rows.dim() != 2 or lengths.shape != expected.shape or not torch.equal(lengths, expected):
            raise ValueError(
                f"{key!r}: a jagged per-token entry must have one value per valid token of each row; "
                f"got row lengths {lengths.tolist()[:8]} in {key!r} for token counts {expected.tolist()[:8]} in "
                f"{tokens_key!r}. Both must come from the same tokenisation (score the batch's tokens with "
                "input_mode='tokens')."
            )
        return rows.new_zeros(attention.shape).masked_scatter(attention.to(rows.device), rows[padded.mask])
    value = _squeeze_feature(value)
    if nested_tokens:
        raise ValueError(
            f"{key!r}: the tokens are jagged (nested) in {tokens_key!r} but this entry is padded "
            f"{tuple(value.shape)}, so "
            "its alignment is unknown. Store both jagged or both padded (pad_output=True)."
        )
    if value.shape != attention.shape:
        raise ValueError(
            f"{key!r}: expected a per-token tensor [B, T] = {tuple(attention.shape)} (the shape of the tokens "
            f"{tokens_key!r}), or [B, T, 1]; got {tuple(value.shape)} from {key!r}. Per-token entries must be "
            "written on the tokens they score: a scorer that re-rendered chats or text after sampling made other "
            "tokens (score the batch's own with input_mode='tokens')."
        )
    return value


def _tokens(td: TensorDictBase, keys: GRPOKeys) -> tuple[Tensor, Tensor, bool]:
    tokens = _fetch(td, keys.action, "the token ids [B, T]", "Set it with loss.set_keys(action=...).")
    check_token_ids(repr(keys.action), tokens)
    if tokens.is_nested:
        padded = nested_to_padded(tokens, padding_side="right")
        return padded.values.long(), padded.mask, True
    if tokens.dim() != 2:
        raise ValueError(f"{keys.action!r}: expected token ids [B, T], got shape {tuple(tokens.shape)}.")
    attention = _fetch(
        td, keys.attention_mask, "the attention mask of the padded tokens",
        "Padded tokens need their mask (set it with loss.set_keys(attention_mask=...)).",
    )
    attention = _on_grid(attention, keys.attention_mask, torch.ones_like(tokens, dtype=torch.bool), False)
    check_same_device(repr(keys.attention_mask), attention, repr(keys.action), tokens)
    return tokens.long(), check_mask(repr(keys.attention_mask), attention), False


def _check_finite(value: Tensor, mask: Tensor, key: NestedKey) -> None:
    bad = mask & ~torch.isfinite(value)
    if bool(bad.any()):
        raise ValueError(
            f"{key!r}: {int(bad.sum())} value(s) inside the loss mask are not finite. Only positions "
            "outside the mask may hold NaN/inf padding."
        )


def _zero_outside(value: Tensor, mask: Tensor, key: NestedKey) -> Tensor:
    """``value`` with 0 outside ``mask`` once every value inside it is checked finite."""
    mask = mask.to(value.device)
    _check_finite(value, mask, key)
    return torch.where(mask, value, torch.zeros((), dtype=value.dtype, device=value.device))


def _advantage(td: TensorDictBase, key: NestedKey, attention: Tensor, nested_tokens: bool,
               tokens_key: NestedKey) -> Tensor:
    value = _fetch(td, key, "the advantages", "Compute them first (e.g. with MCAdvantage).")
    rows = attention.shape[0]
    if not value.is_nested and value.dim() <= 3 and value.shape[:1] == (rows,) and value.numel() == rows:
        # One advantage per answer ([B], [B, 1], TorchRL's [B, 1, 1]): broadcast over its tokens.
        return value.reshape(rows, 1)
    if value.is_nested or value.dim() in (2, 3):
        return _on_grid(value, key, attention, nested_tokens, tokens_key)
    raise ValueError(
        f"{key!r}: expected advantages [B], [B, 1], [B, 1, 1] (one per answer) or [B, T], [B, T, 1] (per token) "
        f"with B = {rows}; got shape {tuple(value.shape)}."
    )


# Where tether.llm.KLRewardTransform writes the reference log-probs (its SPEC-listed key).
TRANSFORM_REF_LOG_PROB = "ref_log_prob"


def _ref_log_probs(td: TensorDictBase, key: NestedKey) -> Tensor:
    """The reference log-probs at ``key``, else under ``"next"``; for the default key also
    where ``tether.llm.KLRewardTransform`` puts them, so its output feeds the loss as is."""
    candidates = [key, ("next", *((key,) if isinstance(key, str) else key))]
    if key == GRPOKeys.ref_log_probs:
        candidates += [TRANSFORM_REF_LOG_PROB, ("next", TRANSFORM_REF_LOG_PROB)]
    for candidate in candidates:
        if has_key(td, candidate):
            return _fetch(td, candidate, "the reference log-probs")
    raise missing_key(
        td, key, "Add them with tether.llm.RetrieveLogProb / RetrieveKL / KLRewardTransform, or pass kl_to_ref_coeff=None.",
        what=f"the reference log-probs (also looked up under 'next'{', and at ' + repr(candidates[2:]) if len(candidates) > 2 else ''})",
    )


def read_grpo_batch(td: TensorDictBase, keys: GRPOKeys, *, with_ref: bool, with_old: bool) -> GRPOBatch:
    """Read and align everything one ``GRPOLoss`` call needs.

    Args:
        td: the batch (padded with masks, or jagged).
        keys: where each entry lives.
        with_ref: read the reference log-probs (KeyError if absent).
        with_old: read the trainer's old log-probs if present (None otherwise).

    Returns:
        ``GRPOBatch`` on the tokens' grid, values zeroed outside the training mask.
    """
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"tensordict: expected a TensorDict, got {type(td).__name__}.")
    tokens, attention, nested = _tokens(td, keys)
    first, _ = row_runs(attention)
    if keys.loss_mask is None:  # every valid token that has a prediction (TorchRL's "generic" masking)
        mask = attention.scatter(1, first[:, None], False)
    else:
        loss_mask = _fetch(td, keys.loss_mask, "the mask of the tokens to train on",
                           "Set it with loss.set_keys(loss_mask=...).")
        loss_mask = _on_grid(loss_mask, keys.loss_mask, attention, nested, keys.action)
        check_same_device(repr(keys.loss_mask), loss_mask, repr(keys.action), attention)
        mask = check_mask(repr(keys.loss_mask), loss_mask) & attention
        if bool(mask.gather(1, first[:, None]).any()):
            raise ValueError(
                f"{keys.loss_mask!r}: the mask covers the first token of a row, which has no prediction "
                "(no log-prob). Train on response tokens only."
            )
    sample = _fetch(td, keys.sample_log_prob, "the sampling log-probs", "They are written at generation time.")
    if sample.requires_grad:
        raise ValueError(
            f"{keys.sample_log_prob!r}: the stored sampling log-probs require grad; they must be constants "
            "recorded at sampling time. Store them detached (tensor.detach())."
        )
    def clean(value: Tensor, key: NestedKey) -> Tensor:
        return _zero_outside(_on_grid(value, key, attention, nested, keys.action), mask, key)

    advantage = _advantage(td, keys.advantage, attention, nested, keys.action)
    if advantage.shape == mask.shape:
        advantage = clean(advantage, keys.advantage)
    else:
        _check_finite(advantage, torch.ones_like(advantage, dtype=torch.bool), keys.advantage)
    ref = clean(_ref_log_probs(td, keys.ref_log_probs), keys.ref_log_probs) if with_ref else None
    old = None
    if with_old and has_key(td, keys.old_log_probs):
        old = clean(_fetch(td, keys.old_log_probs, "the old log-probs").detach(), keys.old_log_probs)
    return GRPOBatch(
        tokens=tokens,
        attention_mask=attention,
        mask=mask,
        sample_log_probs=clean(sample, keys.sample_log_prob),
        advantage=advantage,
        ref_log_probs=None if ref is None else ref.detach(),
        old_log_probs=old,
    )


def grpo_batch_from_record(record: StepRecord, *, with_ref: bool, with_old: bool) -> GRPOBatch:
    """The ``GRPOBatch`` of a ``StepRecord`` whose reference (if ``with_ref``) and advantage
    stages have run; the same checks and zeroing as ``read_grpo_batch``, with no key look-ups."""
    mask = record.assistant_mask & record.attention_mask
    if record.advantages is None:
        raise ValueError("StepRecord.advantages is None: run the advantage stage before the loss.")
    if with_ref and record.ref_log_probs is None:
        raise ValueError("StepRecord.ref_log_probs is None: run the reference stage before the loss, or build the "
                         "loss with kl_to_ref_coeff=None.")

    def clean(value: Tensor | None, name: str) -> Tensor | None:
        return None if value is None else _zero_outside(value, mask, f"StepRecord.{name}").detach()

    # [B] (one advantage per answer) goes onto the grid like [B, T], so one check covers both.
    advantage = record.advantages[:, None].expand_as(mask) if record.advantages.dim() == 1 else record.advantages
    return GRPOBatch(
        tokens=record.tokens,
        attention_mask=record.attention_mask,
        mask=mask,
        sample_log_probs=clean(record.sample_log_probs, "sample_log_probs"),
        advantage=clean(advantage, "advantages"),
        ref_log_probs=clean(record.ref_log_probs, "ref_log_probs") if with_ref else None,
        old_log_probs=clean(record.old_log_probs, "old_log_probs") if with_old else None,
    )


# TorchRL's spellings of the aggregation modes that tether also has.
AGGREGATION_ALIASES = {"token_mean": "token-mean", "prompt_mean": "seq-mean-token-mean"}
# TorchRL 0.14's masking_strategy -> the mask the loss trains on. "sft" (the response after the
# prompt) is the assistant mask here: tether never trains on tool or user tokens of later turns.
MASKING_STRATEGIES = {"sft": GRPOKeys.loss_mask, "rlhf": GRPOKeys.loss_mask, "generic": None}


def refuse_torchrl_only(kl_mask_threshold: object, reduction: object) -> None:
    """TorchRL 0.14 keywords tether has no equivalent for, refused by name with the change to make."""
    if kl_mask_threshold is not None:
        raise TypeError(
            f"GRPOLoss: kl_mask_threshold={kl_mask_threshold!r} (TorchRL 0.14's per-token KL mask) is not "
            "supported; drop it. tether holds the KL with a controller instead (tether.control, "
            "kl_controller='budget' in tether train)."
        )
    if reduction not in (None, "mean"):
        raise TypeError(
            f"GRPOLoss: reduction={reduction!r} is not supported (TorchRL applies it after the aggregation; "
            "tether's losses are already reduced by `aggregation`). Drop it, and for per-token values "
            "use GRPOLoss.token_terms(batch)."
        )
