"""Picklable model factories for the Ray tests; Ray workers import this module by name.

Each factory builds its tiny float64 model from a fixed seed, so a model built inside an
actor equals the one a test builds locally, weight for weight. ``logging_scorer`` also
records, in a file that outlives the actor, which request every scored row came from.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.helpers import make_tiny_model, make_tokenizer
from tether.models import TransformersWrapper


def reference_scorer(seed: int = 1, log_path: str | None = None, **kwargs) -> TransformersWrapper:
    """Scoring wrapper of a float64 tiny model; appends this process's pid to ``log_path``."""
    if log_path is not None:
        with Path(log_path).open("a") as fh:
            fh.write(f"{os.getpid()}\n")
    tok = make_tokenizer()
    model = make_tiny_model(tok, dtype=torch.float64, seed=seed)
    return TransformersWrapper(model, tok, generate=False, log_probs_key="ref_log_probs", **kwargs)


class LoggingScorer(TransformersWrapper):
    """A reference scorer that appends the request id of the rows of every ``score`` call to a file.

    The service packs requests into one grid, so rows are traced back to requests by their
    valid tokens (``id_by_row``: tuple of token ids -> request id; rows must be distinct).
    """

    def __init__(self, *args, log_path: str, id_by_row: dict[tuple[int, ...], str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log_path = log_path
        self.id_by_row = id_by_row

    def score(self, tokens, attention_mask, **kwargs):
        out = super().score(tokens, attention_mask, **kwargs)
        ids = {self.id_by_row[tuple(row[keep].tolist())] for row, keep in zip(tokens, attention_mask.bool())}
        with Path(self.log_path).open("a") as fh:  # after scoring: a call that died midway logs nothing
            fh.writelines(f"{rid}\n" for rid in sorted(ids))
        return out


def logging_scorer(log_path: str, id_by_row: dict[tuple[int, ...], str]) -> LoggingScorer:
    """The float64 reference of ``reference_scorer`` wrapped in a ``LoggingScorer``."""
    tok = make_tokenizer()
    return LoggingScorer(make_tiny_model(tok, dtype=torch.float64, seed=1), tok, generate=False,
                         log_probs_key="ref_log_probs", log_path=log_path, id_by_row=id_by_row)


def policy_scorer(seed: int = 0) -> TransformersWrapper:
    """Scoring wrapper of the float64 tiny policy (log-probs under the default key)."""
    tok = make_tokenizer()
    return TransformersWrapper(make_tiny_model(tok, dtype=torch.float64, seed=seed), tok, generate=False)


def broken_scorer() -> TransformersWrapper:
    """A factory that fails inside the actor, as a missing model file would."""
    raise FileNotFoundError("no such model: /nonexistent/reference")


class PickyScorer(TransformersWrapper):
    """A reference scorer whose ``score`` fails on any batch holding ``bad_token`` under the mask,
    as a model fails on an input only it cannot take (the service's arrival checks pass it)."""

    def __init__(self, *args, bad_token: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bad_token = bad_token

    def score(self, tokens, attention_mask, **kwargs):
        if (tokens[attention_mask.bool()] == self.bad_token).any():
            raise RuntimeError(f"cannot score token {self.bad_token}")
        return super().score(tokens, attention_mask, **kwargs)


def picky_scorer(bad_token: int) -> PickyScorer:
    """The float64 reference of ``reference_scorer`` wrapped in a ``PickyScorer``."""
    tok = make_tokenizer()
    return PickyScorer(make_tiny_model(tok, dtype=torch.float64, seed=1), tok, generate=False,
                       log_probs_key="ref_log_probs", bad_token=bad_token)
