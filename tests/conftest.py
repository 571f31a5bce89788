"""Shared fixtures: tiny tokenizers and models for unit tests, the embedded model for integration."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_tiny_model, make_tokenizer


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
