"""What every KL controller reads and writes: the mean KL per sequence of a batch (``SequenceKL``), the
beta it pushes into the modules it drives, and the keys of its state dict (one place for each check).

A controller's law reads a checked ``SequenceKL`` (``step``); tether's callers build it from their one
tensor of per-sequence KLs (``sequence_kl``). The other input forms of TorchRL's controllers (a list,
a mean with ``n_steps``) are read only by ``torchrl_kl``, behind each controller's public ``update``."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tether.ops.checks import whole_number

_N_STEPS_FIX = "Pass the number of sequences the KL was measured on (the batch size)."


def one_knob(owner: str, name: str, value: Any, alias: str, alias_value: Any) -> Any:
    """The value of a knob a constructor takes under TorchRL's ``name`` or tether train's config
    name ``alias``: exactly one of the two, or a ``TypeError`` naming both."""
    if value is not None and alias_value is not None:
        raise TypeError(f"{owner}: {name}={value!r} and {alias}={alias_value!r} are one knob (TorchRL's name and "
                        "tether train's config name); give one of them.")
    if value is None and alias_value is None:
        raise TypeError(f"{owner}: {name} is required (tether train's config calls it {alias}; either name is taken).")
    return value if value is not None else alias_value


def control_targets(model: Any) -> tuple[Any, ...]:
    """Normalises ``model`` (None, one object or a list/tuple) and checks each has ``kl_coef``."""
    if model is None:
        return ()
    targets = tuple(model) if isinstance(model, (list, tuple)) else (model,)
    for index, target in enumerate(targets):
        if not hasattr(target, "kl_coef"):
            where = f"model[{index}]" if isinstance(model, (list, tuple)) else "model"
            raise TypeError(
                f"{where} must expose a read/write `kl_coef` attribute; got an object of type "
                f"{type(target).__name__} without one. Pass the component whose KL term the "
                f"controller should drive (e.g. a KLRewardTransform or a loss with kl_coef)."
            )
    return targets


def push_coef(targets: tuple[Any, ...], coef: float) -> None:
    """Writes ``coef`` to every driven object, turning a read-only attribute into a clear error."""
    for target in targets:
        try:
            target.kl_coef = coef
        except AttributeError as err:
            raise TypeError(
                f"model.kl_coef of {type(target).__name__} is read-only; the controller needs "
                f"to write it. Give that class a `kl_coef` setter."
            ) from err


@dataclass(frozen=True)
class SequenceKL:
    """A batch's KL as every controller reads it: ``mean`` over sequences of each sequence's summed
    KL (nats per sequence, finite) and ``count``, the sequences it was measured on (>= 1)."""

    mean: float
    count: int


def sequence_kl(values: torch.Tensor) -> SequenceKL:
    """tether's one form: ``values [N]``, the per-sequence summed KLs (any dtype or device)."""
    if values.dim() != 1:
        raise ValueError(
            f"kl_values must hold one KL per sequence (shape [N]); got shape "
            f"{tuple(values.shape)}. Sum the per-token KL over each sequence's valid tokens "
            f"first, e.g. (kl * mask).sum(-1)."
        )
    if values.numel() == 0:
        raise ValueError("kl_values is empty; expected at least one per-sequence KL.")
    return SequenceKL(_finite_mean(values.detach().to(dtype=torch.float64).mean()), values.numel())


def torchrl_kl(kl_values: Any, n_steps: int | None) -> SequenceKL:
    """The forms TorchRL's controllers take in ``update(kl_values, n_steps)`` (SPEC section 6),
    read into a ``SequenceKL``: a tensor or sequence of N per-sequence KLs (``n_steps``, when
    given, must be N), or their mean (a number or 0-dim tensor) with ``n_steps`` required."""
    if kl_values is None:
        raise ValueError(
            "kl_values is required by the controller's update; got None. Pass the "
            "per-sequence summed KLs of the last batch (a 1-D tensor or list), or their mean "
            "together with n_steps."
        )
    values = _as_tensor(kl_values)
    if values.dim() == 0:
        if n_steps is None:
            raise ValueError(
                "n_steps is required when kl_values is a scalar mean; got None. Pass the "
                "number of sequences that mean was taken over."
            )
        count = whole_number("n_steps", n_steps, low=1, fix=_N_STEPS_FIX)
        return SequenceKL(_finite_mean(values), count)
    read = sequence_kl(values)
    if n_steps is not None and whole_number("n_steps", n_steps, low=1, fix=_N_STEPS_FIX) != read.count:
        raise ValueError(
            f"n_steps={n_steps} disagrees with len(kl_values)={read.count}; n_steps counts the "
            f"sequences in kl_values. Omit n_steps when passing one KL per sequence."
        )
    return read


def _as_tensor(kl_values: Any) -> torch.Tensor:
    if isinstance(kl_values, torch.Tensor):
        return kl_values.detach().to(device="cpu", dtype=torch.float64)
    if isinstance(kl_values, numbers.Real) and not isinstance(kl_values, bool):
        return torch.tensor(float(kl_values), dtype=torch.float64)
    if isinstance(kl_values, Iterable) and not isinstance(kl_values, (str, bytes)):
        try:
            # float() takes numbers and one-element tensors alike (e.g. a deque of 0-dim KLs).
            return torch.tensor([float(v) for v in kl_values], dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(
                f"kl_values must contain one number per sequence; could not read it as "
                f"floats ({err}). Pass a 1-D tensor or a list of floats."
            ) from err
    raise TypeError(
        f"kl_values must be a 1-D tensor, a sequence of floats or a scalar; got "
        f"{type(kl_values).__name__}. Pass the per-sequence summed KLs."
    )


def _finite_mean(mean: torch.Tensor) -> float:
    value = float(mean)
    if not math.isfinite(value):
        raise ValueError(
            f"kl_values must be finite; got a mean of {value}. Check the log-probs for -inf "
            f"(e.g. a reference model that gives a sampled token zero probability)."
        )
    return value


def check_state_keys(state: dict[str, Any], expected: tuple[str, ...], owner: str) -> None:
    missing = [key for key in expected if key not in state]
    extra = [key for key in state if key not in expected]
    if missing or extra:
        raise KeyError(
            f"{owner}.load_state_dict expected keys {list(expected)}; missing {missing}, "
            f"unexpected {extra}. Pass a dict produced by {owner}.state_dict()."
        )
