"""Argument checks: the one place every layer validates a number or a variant name it was given.

Each check names the argument, says what it expected and what came, and may add how to fix it,
always in the words ``"{name}: expected {what}, got {value!r}. {fix}"``. A value of the wrong
type raises ``TypeError``; a number of the right type outside its range (NaN and infinities
included, unless allowed) raises ``ValueError``. ``bool`` is never taken for a number.
Every variant family (KL estimators, aggregation and advantage modes, KL controllers, config
choices) is a plain ``dict`` from name to implementation, read by a user-given name only through
``lookup``, so a typo anywhere lists the names to choose from in the same words. The
vocabulary reductions (``logprobs``, ``exact_kl``) check their tensors here too (logits, an
``lm_head``, labels, masks, temperature, chunk size), so their messages are identical.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = ["choice_error", "kl_coefficient", "lookup", "problems", "real_number", "whole_number"]


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high:g}"
    return ""


def _fail(kind: type[Exception], name: str, what: str, got: str, fix: str) -> Exception:
    return kind(f"{name}: expected {what}, got {got}." + (f" {fix}" if fix else ""))


def real_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False, allow_inf: bool = False,
                tensor_ok: bool = False, fix: str = "") -> float:
    """``value`` as a Python float inside the given range.

    Args:
        name: the argument's name, as the caller knows it.
        value: what came.
        low, high: bounds of the range (None: unbounded on that side).
        low_open, high_open: exclude the bound itself.
        allow_inf: accept an infinity the range allows (NaN is never accepted).
        tensor_ok: accept a one-element tensor (e.g. a coefficient held as a buffer).
        fix: a sentence appended to the error saying how to fix the call.
    """
    what = ("a number" if allow_inf else "a finite number") + _bounds(low, high, low_open, high_open)
    if tensor_ok and isinstance(value, Tensor) and value.numel() == 1 and value.dtype != torch.bool:
        value = float(value.detach())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(TypeError, name, what, f"{value!r} of type {type(value).__name__}", fix)
    number = float(value)
    inside = not math.isnan(number) and (allow_inf or math.isfinite(number))
    if low is not None:
        inside = inside and (number > low if low_open else number >= low)
    if high is not None:
        inside = inside and (number < high if high_open else number <= high)
    if not inside:
        raise _fail(ValueError, name, what, f"{value!r}", fix)
    return number


def whole_number(name: str, value: Any, *, low: int | None = None, high: int | None = None,
                 fix: str = "") -> int:
    """``value`` as a Python int in ``[low, high]`` (an integral number; floats such as ``2.0`` are refused).

    Args:
        name: the argument's name, as the caller knows it.
        value: what came.
        low, high: the smallest and largest accepted values (None: unbounded on that side).
        fix: a sentence appended to the error saying how to fix the call.
    """
    what = "an int" + _bounds(low, high, False, False)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(TypeError, name, what, f"{value!r} of type {type(value).__name__}", fix)
    if (low is not None and value < low) or (high is not None and value > high):
        raise _fail(ValueError, name, what, f"{value!r}", fix)
    return int(value)


def kl_coefficient(name: str, value: Any) -> float:
    """A KL coefficient (beta): finite and >= 0, a number or a one-element tensor."""
    return real_number(name, value, low=0, tensor_ok=True,
                       fix="A negative coefficient would reward drifting away from the reference.")


def problems(check: Callable[..., Any], name: str, value: Any, **bounds: Any) -> list[str]:
    """``check(name, value, **bounds)``'s error as a one-item list, empty when it passes: for
    validators that list every bad field at once (``TrainConfig.validate``)."""
    try:
        check(name, value, **bounds)
    except (TypeError, ValueError) as exc:
        return [str(exc)]
    return []


T = TypeVar("T")


def choice_error(argument: str, value: object, choices: Iterable[Hashable]) -> ValueError:
    """The ``ValueError`` for ``argument=value`` not being one of ``choices``."""
    supported = ", ".join(repr(name) for name in choices)
    return ValueError(f"{argument}: expected one of {supported}, got {value!r}.")


def lookup(table: Mapping[str, T], name: object, argument: str) -> T:
    """``table[name]``, or a ``ValueError`` naming ``argument`` and listing the table's names."""
    if not isinstance(name, Hashable) or name not in table:
        raise choice_error(argument, name, table)
    return table[name]


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16 / fp16 are upcast)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def check_temperature(temperature: object) -> float:
    """Return ``temperature`` as a float after checking it is a finite number > 0."""
    return real_number("temperature", temperature, low=0, low_open=True,
                       fix="Pass the temperature the samples were drawn with (1.0 for the plain softmax) as a "
                           "Python number (a tensor would force a host sync).")


def check_chunk_size(chunk_size: object, *, allow_none: bool) -> int | None:
    """Return ``chunk_size`` after checking it is a positive int (or None where allowed)."""
    if chunk_size is None and allow_none:
        return None
    return whole_number("chunk_size", chunk_size, low=1,
                        fix="Pass the number of tokens per chunk, e.g. 1024" + (", or None." if allow_none else "."))


def _check_float_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.dtype.is_floating_point:
        raise TypeError(
            f"{name} must be a floating point tensor, got dtype {value.dtype}; "
            f"convert it with {name}.float()"
        )
    return value


def check_logits(name: str, logits: object) -> Tensor:
    """``logits`` must be a floating tensor ``[..., T, V]`` with ``V >= 1``."""
    _check_float_tensor(name, logits)
    if logits.dim() < 2 or logits.shape[-1] == 0:
        raise ValueError(
            f"{name} must have shape [..., T, V] with V >= 1, got {tuple(logits.shape)}; "
            "add the token dimension (e.g. logits[None]) or check the vocabulary size"
        )
    return logits


def check_same_device(name: str, value: Tensor, ref_name: str, ref: Tensor) -> None:
    if value.device != ref.device:
        raise ValueError(
            f"{name} is on {value.device} but {ref_name} is on {ref.device}; "
            f"move {name} with .to({ref_name}.device)"
        )


def check_head(
    hidden: object,
    weight: object,
    bias: object,
    hidden_name: str,
    weight_name: str,
    bias_name: str,
) -> None:
    """``hidden [..., T, H]``, ``weight [V, H]``, ``bias [V]`` or None, one dtype, one device."""
    _check_float_tensor(hidden_name, hidden)
    _check_float_tensor(weight_name, weight)
    if hidden.dim() < 2:
        raise ValueError(
            f"{hidden_name} must have shape [..., T, H], got {tuple(hidden.shape)}; "
            f"add the token dimension, e.g. {hidden_name}[None]"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(
            f"{weight_name} must have shape [V, H] with V >= 1 and H = {hidden_name}.shape[-1]"
            f" = {hidden.shape[-1]}, got {tuple(weight.shape)}; pass lm_head.weight of the "
            "model that produced the hidden states"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"{weight_name} has dtype {weight.dtype} but {hidden_name} has {hidden.dtype}; "
            f"cast one of them so both match (the projection runs in the model dtype)"
        )
    check_same_device(weight_name, weight, hidden_name, hidden)
    if bias is None:
        return
    _check_float_tensor(bias_name, bias)
    if tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"{bias_name} must have shape [V] = ({weight.shape[0]},), got "
            f"{tuple(bias.shape)}; pass lm_head.bias or None"
        )
    if bias.dtype != weight.dtype:
        raise TypeError(
            f"{bias_name} has dtype {bias.dtype} but {weight_name} has {weight.dtype}; "
            "cast the bias to the weight dtype"
        )
    check_same_device(bias_name, bias, weight_name, weight)


def check_token_ids(name: str, ids: object) -> Tensor:
    """``ids`` must be an integer tensor: float ids would be truncated, bools are masks."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(
            f"{name} must be an integer tensor (torch.long), got dtype {ids.dtype}; "
            f"store token ids as integers (e.g. {name}.long() once they are whole numbers)"
        )
    return ids


def check_mask(name: str, mask: object) -> Tensor:
    """Return ``mask`` as bool: bool as is, integers only if every entry is 0 or 1.

    Float masks are refused rather than binarised (0.3 is neither in nor out); integer
    masks (Hugging Face's attention masks) are accepted when exactly 0/1, which costs one
    host read, and never for bool masks.
    """
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a bool tensor, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(
            f"{name} must be a bool (or 0/1 integer) mask, got dtype {mask.dtype}; float masks "
            f"are refused, not rounded. Build it as bool, e.g. {name} > 0.5 if that is meant"
        )
    if mask.numel() and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(
            f"{name} must hold only 0 and 1, got values in [{int(mask.min())}, {int(mask.max())}]; "
            f"pass a bool mask"
        )
    return mask.bool()


def check_labels(
    labels: object, lead_shape: torch.Size, device: torch.device, source: str
) -> Tensor:
    """Return ``labels`` as int64 after checking dtype, shape ``lead_shape`` and device.

    The value range is checked after the forward, by :func:`check_scored`, together with
    the positions that have no finite logit: one host read for both.
    """
    check_token_ids("labels", labels)
    if labels.shape != lead_shape:
        raise ValueError(
            f"labels must have shape {tuple(lead_shape)} ({source}.shape[:-1]), got "
            f"{tuple(labels.shape)}; pass one label per scored position, aligned by the caller"
        )
    if labels.device != device:
        raise ValueError(
            f"labels is on {labels.device} but {source} is on {device}; "
            f"move labels with .to({source}.device)"
        )
    return labels.long()


def check_scored(
    labels: Tensor, vocab: int, lse: Tensor, lead_shape: torch.Size, source: str
) -> None:
    """Labels in ``[0, V)`` and a finite logit at every position, read back in one sync.

    ``labels`` and ``lse`` (the log-sum-exp of each position) are flat ``[N]``. The forward
    runs on clamped labels so that an out-of-range id cannot fail inside ``gather`` (a
    device-side assert on GPU) before this check names it. A log-sum-exp of ``-inf`` means
    every logit of the position is ``-inf``: no distribution, and NaN log-probs.
    """
    no_mass = lse == float("-inf")
    flag = no_mass.any()
    if labels.numel() > 0:
        low, high = torch.aminmax(labels)
        flag = flag | (low < 0) | (high >= vocab)
    if not bool(flag):
        return
    if labels.numel() > 0 and bool((low < 0) | (high >= vocab)):
        raise ValueError(
            f"labels must lie in [0, V) = [0, {vocab}), got values in [{int(low)}, "
            f"{int(high)}]; replace ignore ids such as -100 by any valid id (e.g. 0) "
            "and mask those positions afterwards"
        )
    flat = no_mass.nonzero().flatten()
    where = torch.stack(torch.unravel_index(flat[:8], lead_shape), -1).tolist()
    raise ValueError(
        f"{source}: the logits at {len(flat)} position(s) are all -inf, e.g. at index "
        f"{[tuple(w) for w in where]} of {source}.shape[:-1] = {tuple(lead_shape)}; "
        "softmax(logits / temperature) has no distribution there and the log-probs would be "
        "NaN. Keep at least one vocabulary entry finite at every position (a vocabulary "
        "mask or -inf bias removed them all), or leave those positions out."
    )
