"""End-of-sequence and padding ids, from the caller, the tokenizer or the model: the one policy.

Every component that samples, pads or ends responses (``TransformersWrapper``,
``RolloutFromModel``, ``SequenceRewardModel``) resolves its ids here. An explicit argument wins, then the tokenizer,
then the model's generation config and config; finding nothing is an error naming the
keyword to pass, never a guess (TorchRL hard-coded GPT-2's 50256, and an earlier
tether wrapper fell back to the smallest eos id).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tether.ops.checks import whole_number

__all__ = ["missing_pad_id", "resolve_eos_ids", "resolve_pad_id"]


def _as_ids(name: str, value: Any) -> tuple[int, ...]:
    values = list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value]
    if not values:
        raise TypeError(f"{name}: expected an int >= 0 or a non-empty list of them, got {value!r}.")
    return tuple(sorted({whole_number(name, v, low=0, fix="Pass a token id or a list of them.") for v in values}))


def _sources(model: nn.Module, tokenizer: Any) -> tuple[Any, Any, Any]:
    return tokenizer, getattr(model, "generation_config", None), getattr(model, "config", None)


def resolve_eos_ids(eos_token_id: Any, model: nn.Module, tokenizer: Any, *, owner: str = "RolloutFromModel") -> tuple[int, ...]:
    """The ids that end a response (``owner`` names the component in the error).

    ``eos_token_id`` (an int or a list) if given; else the union of the tokenizer's, the
    generation config's and the config's eos ids (a model may list several, e.g. chat
    models that stop on an end-of-turn token too).
    """
    if eos_token_id is not None:
        return _as_ids("eos_token_id", eos_token_id)
    found: set[int] = set()
    for source in _sources(model, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            found.update(_as_ids("eos_token_id (found on the tokenizer/model)", value))
    if not found:
        raise ValueError(
            "eos_token_id: none given and none found on the tokenizer, model.generation_config "
            f"or model.config. Pass eos_token_id=<id> (or tokenizer=...) to {owner}."
        )
    return tuple(sorted(found))


def _one_id(name: str, value: Any) -> int:
    return whole_number(name, value, low=0, fix="Pass one token id.")


def resolve_pad_id(pad_token_id: Any, model: nn.Module, tokenizer: Any, *, owner: str = "RolloutFromModel",
                   required: bool = True) -> int | None:
    """The id written after a response ends: the argument, else the first one found.

    Finding none raises ``missing_pad_id(owner)``, or with ``required=False`` gives None for
    a component that needs the id only for some calls (it raises that error there).
    """
    if pad_token_id is not None:
        return _one_id("pad_token_id", pad_token_id)
    for source in _sources(model, tokenizer):
        value = getattr(source, "pad_token_id", None)
        if value is not None:
            return _one_id("pad_token_id (found on the tokenizer/model)", value)
    if required:
        raise missing_pad_id(owner)
    return None


def missing_pad_id(owner: str) -> ValueError:
    """The error for a pad id that was neither given nor found."""
    return ValueError(
        "pad_token_id: none given and none found on the tokenizer, model.generation_config or "
        f"model.config. Pass pad_token_id=<id> to {owner} (the eos id is a common choice "
        "for models trained without a pad token)."
    )
