"""``load_named``: copies by parameter name, and refuses unknown names or shapes before copying."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tether.models.weights import load_named


def test_copies_by_name_and_refuses_before_copying_anything():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    state = {"0.bias": torch.tensor([1.0, 2.0, 3.0]), "1.weight": torch.full((1, 3), 0.5)}
    assert load_named(model, state, owner="the model", fix="Fix it.") == 2
    assert torch.equal(model[0].bias, state["0.bias"]) and torch.equal(model[1].weight, state["1.weight"])
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(KeyError, match=r"\['2.weight'\] are not parameters of the model .*Fix it."):
        load_named(model, {"0.bias": torch.zeros(3), "2.weight": torch.zeros(1)}, owner="the model", fix="Fix it.")
    with pytest.raises(ValueError, match=r"tensors for the model have other shapes .*0.bias: \[4\] for \[3\]"):
        load_named(model, {"1.bias": torch.zeros(1), "0.bias": torch.zeros(4)}, owner="the model", fix="Fix it.")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing half-copied


def test_named_tensors_receive_and_complete_requires_every_name():
    a, b = torch.zeros(2), torch.zeros(1)
    assert load_named({"a": a, "b": b}, {"a": torch.ones(2)}, owner="the pair", fix="Fix it.") == 1
    assert torch.equal(a, torch.ones(2)) and torch.equal(b, torch.zeros(1))
    with pytest.raises(KeyError, match=r"\['b'\] of the pair are missing from the tensors sent. Fix it."):
        load_named({"a": a, "b": b}, {"a": torch.zeros(2)}, owner="the pair", fix="Fix it.", complete=True)
    assert torch.equal(a, torch.ones(2))  # refused before copying
