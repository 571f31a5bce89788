"""Shared fixtures: tiny tokenizers and models for unit tests, the embedded model for integration."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

from tests.helpers import make_tiny_model, make_tokenizer

# CI replays the same examples every run, so a red build is reproducible by rerunning it;
# HYPOTHESIS_PROFILE=explore draws fresh examples when hunting for new failures.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    return make_tiny_model(tokenizer)


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, loaded once per test session."""
    from tether.models import load_default_model

    model, tokenizer = load_default_model()
    return model, tokenizer


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
