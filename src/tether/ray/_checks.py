"""Argument checks shared by the Ray transforms and the reference service: which models, how built."""

from __future__ import annotations

from typing import Any

import torch

from tether.llm.retrieve_kl import resolve_reference

__all__ = ["check_model_args"]


def check_model_args(ref_model: Any, ref_model_factory: Any, gen_model: Any = None,
                     gen_model_factory: Any = None) -> None:
    """Exactly one of ref_model / ref_model_factory; at most one of gen_model / gen_model_factory."""
    given_ref = [name for name, value in (("ref_model", ref_model), ("ref_model_factory", ref_model_factory))
                 if value is not None]
    if len(given_ref) == 2:
        raise ValueError(
            "ref_model and ref_model_factory were both given; expected exactly one. Prefer "
            "ref_model_factory (called inside the actor, so no weights are shipped) and drop ref_model."
        )
    if not given_ref:
        raise ValueError(
            "ref_model / ref_model_factory: expected exactly one, got neither. Pass "
            "ref_model_factory=<callable returning a scoring TransformersWrapper> (built inside the "
            "actor) or ref_model=<TransformersWrapper> (pickled and shipped to it)."
        )
    if sum(value is not None for value in (gen_model, gen_model_factory)) > 1:
        raise ValueError(
            "gen_model and gen_model_factory were both given; expected at most one (neither reuses "
            "the log-probs recorded at sampling time). Drop one of them."
        )
    for name, factory in (("ref_model_factory", ref_model_factory), ("gen_model_factory", gen_model_factory)):
        if factory is not None and (isinstance(factory, torch.nn.Module) or not callable(factory)):
            raise TypeError(
                f"{name}: expected a callable returning a TransformersWrapper, got "
                f"{type(factory).__name__}. Pass a built wrapper as {name.removesuffix('_factory')} instead."
            )
    if ref_model is not None:
        resolve_reference(ref_model, None)  # type and scoring-mode checks, before shipping it
