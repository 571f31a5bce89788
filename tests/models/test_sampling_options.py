"""Sampling options are checked up front with errors that name them (issue 14)."""

from __future__ import annotations

import math

import pytest
import torch

from tether.models.sampling import sample_responses
from tether.models.wrapper import TransformersWrapper
from tests.helpers import make_tiny_model, make_tokenizer

BAD = [
    ({"temperature": math.inf}, ValueError, r"temperature: expected a finite number > 0, got inf"),
    ({"temperature": "0.7"}, TypeError, r"temperature: expected a finite number > 0, got '0.7' of type str"),
    ({"top_p": 0.0}, ValueError, r"top_p: expected a finite number in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, ValueError, r"top_p: expected a finite number in \(0, 1\]"),
    ({"max_new_tokens": -1}, ValueError, r"max_new_tokens: expected an int >= 1, got -1"),
    ({"max_new_tokens": 2.5}, TypeError, r"max_new_tokens: expected an int >= 1, got 2.5 of type float"),
    ({"top_k": -3}, ValueError, r"top_k: expected an int >= 0, got -3"),
]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model()


@pytest.mark.parametrize("options, error, pattern", BAD)
def test_sample_responses_refuses_bad_options(model, options, error, pattern):
    """Before: inf sampled uniformly, top_p=0 and a string temperature failed inside torch,
    max_new_tokens=-1 gave a bare RuntimeError."""
    kwargs = {"max_new_tokens": 3, "eos_ids": [0], "pad_id": 0, **options}
    with pytest.raises(error, match=pattern):
        sample_responses(model, torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.bool), **kwargs)


@pytest.mark.parametrize("options, error, pattern", BAD)
def test_wrapper_refuses_bad_options_at_construction(model, options, error, pattern):
    temperature = options.get("temperature", 1.0)
    generate_kwargs = {k: v for k, v in options.items() if k != "temperature"}
    with pytest.raises(error, match=pattern):
        TransformersWrapper(model, input_mode="tokens", temperature=temperature, generate_kwargs=generate_kwargs)


def test_float_token_ids_are_refused_in_tokens_mode(model):
    from tensordict import TensorDict

    wrapper = TransformersWrapper(model, input_mode="tokens", generate=False)
    td = TensorDict({("tokens", "full"): torch.tensor([[1.0, 2.5, 3.0]])}, batch_size=[1])
    with pytest.raises(TypeError, match=r"\('tokens', 'full'\) must be an integer tensor.*float32"):
        wrapper(td)


def test_row_limits_cut_rows_like_a_shorter_max_new_tokens():
    """Greedy rows with limits [2, 5, 1] are the first 2, 5, 1 tokens of the unlimited greedy
    rows (same log-probs), unfinished unless an eos fell inside the limit."""
    from tests.models.test_sampling import prompts

    tok = make_tokenizer()
    model = make_tiny_model(tok)
    ids, mask, _ = prompts(tok, ["hello", "a", "what"])
    kw = dict(eos_ids={tok.eos_token_id}, pad_id=tok.pad_token_id, do_sample=False)
    full = sample_responses(model, ids, mask, max_new_tokens=5, **kw)
    cut = sample_responses(model, ids, mask, max_new_tokens=5, row_limits=torch.tensor([2, 5, 1]), **kw)
    for i, n in enumerate([2, 5, 1]):
        n = min(n, int(full.mask[i].sum()))
        assert cut.mask[i].sum() == n
        assert torch.equal(cut.tokens[i, :n], full.tokens[i, :n])
        torch.testing.assert_close(cut.log_probs[i, :n], full.log_probs[i, :n], rtol=0, atol=1e-6)
        assert bool(cut.finished[i]) == bool((cut.tokens[i, :n] == tok.eos_token_id).any())


@pytest.mark.parametrize("limits, error, match", [
    (torch.tensor([1.0, 2.0]), TypeError, "integer tensor"),
    (torch.tensor([1, 2, 3]), ValueError, r"shape \[B\] = \[2\]"),
    (torch.tensor([0, 2]), ValueError, r"values in \[1, max_new_tokens=4\]"),
    (torch.tensor([1, 5]), ValueError, r"values in \[1, max_new_tokens=4\]"),
])
def test_row_limits_refused(limits, error, match):
    tok = make_tokenizer()
    ids = torch.tensor([[65, 66], [65, 67]])
    with pytest.raises(error, match=match):
        sample_responses(make_tiny_model(tok), ids, torch.ones_like(ids, dtype=torch.bool), max_new_tokens=4,
                         eos_ids={tok.eos_token_id}, pad_id=tok.pad_token_id, row_limits=limits)
