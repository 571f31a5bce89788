"""Scoring with a compiled decoder, the one line docs/performance.md gives for faster scoring
(``model.get_decoder().compile(dynamic=True)``): the engine calls the decoder module itself,
so its passes run the compiled graph, and the log-probs equal the eager ones."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.helpers import make_tiny_model, make_tokenizer
from tests.models.test_scoring import ragged_batch
from tether.models.scoring import score_tokens


def _case():
    model = make_tiny_model(make_tokenizer(), dtype=torch.float32).eval()
    ids, mask, _ = ragged_batch([7, 1, 12, 3, 9], padding_side="right", extra=2)
    where = mask.clone()
    where[:, :2] = False  # the head only at some positions, as for an assistant mask
    with torch.no_grad():
        eager = score_tokens(model, ids, mask, token_budget=20, where=where).log_probs
    return model, ids, mask, where, eager


def test_the_engine_runs_its_passes_through_a_compiled_decoder():
    """A backend that records the graphs dynamo hands it (and runs them as traced) proves the
    micro-batched passes (budget 20: several passes of different shapes) went through the
    compiled module, with the eager values (1e-6)."""
    model, ids, mask, where, eager = _case()
    graphs = []

    def recording(graph: torch.fx.GraphModule, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch.compiler.reset()
    model.get_decoder().compile(backend=recording, dynamic=True)
    with torch.no_grad():
        traced = score_tokens(model, ids, mask, token_budget=20, where=where).log_probs
    torch.compiler.reset()
    assert graphs, "no pass went through the compiled decoder"
    torch.testing.assert_close(traced, eager, rtol=0, atol=1e-6)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor needs a C++ compiler")
def test_an_inductor_compiled_decoder_scores_as_eager():
    """The documented line itself: inductor's fused kernels give the eager log-probs at every
    scored position (1e-5, float32: they round differently) and 0 elsewhere."""
    model, ids, mask, where, eager = _case()
    torch.compiler.reset()
    model.get_decoder().compile(dynamic=True)
    with torch.no_grad():
        compiled = score_tokens(model, ids, mask, token_budget=20, where=where).log_probs
    torch.compiler.reset()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)
    assert torch.all(compiled[~where] == 0)
