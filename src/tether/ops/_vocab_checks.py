"""Argument checks shared by the vocabulary reductions.

``logprobs.py`` and ``exact_kl.py`` accept the same kinds of arguments (logits, hidden
states with an ``lm_head``, labels, temperature, chunk size); checking them in one place
keeps their error messages identical. Every failure is a ``TypeError`` or ``ValueError``
naming the argument, what was expected, what came, and how to fix it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tether.ops.checks import real_number, whole_number


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
