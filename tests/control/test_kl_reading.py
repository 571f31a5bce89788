"""How a controller reads a batch's KL: tether's one ``[N]`` tensor (``sequence_kl``) and TorchRL's
input forms (``torchrl_kl``, behind the public ``update``) give the same ``SequenceKL``, and a
controller's ``step`` on it moves beta exactly as ``update`` does."""

from __future__ import annotations

import math
from collections import deque

import pytest
import torch

from tether.control import AdaptiveKLController, BudgetKLController, ConstantKLController, TargetKLController
from tether.control.kl_io import SequenceKL, sequence_kl, torchrl_kl

KLS = [3.0, 6.0, 12.0, 1.5]  # mean 5.625 = (3 + 6 + 12 + 1.5) / 4


@pytest.mark.parametrize("form", [
    lambda: (torch.tensor(KLS), None),
    lambda: (torch.tensor(KLS, dtype=torch.float64), 4),
    lambda: (KLS, None),
    lambda: (tuple(KLS), 4),
    lambda: (deque(torch.tensor(v) for v in KLS), None),  # a queue of 0-dim KLs
    lambda: (5.625, 4),
    lambda: (torch.tensor(5.625), 4),
], ids=["tensor", "tensor+n", "list", "tuple+n", "deque", "mean+n", "0-dim+n"])
def test_every_torchrl_form_reads_as_the_tensor_form(form):
    """Each form carries KLs of mean 5.625 over 4 sequences."""
    kl_values, n_steps = form()
    assert torchrl_kl(kl_values, n_steps) == SequenceKL(5.625, 4) == sequence_kl(torch.tensor(KLS))


@pytest.mark.parametrize("values, error, needle", [
    (torch.ones(2, 3), ValueError, r"one KL per sequence \(shape \[N\]\); got shape \(2, 3\)"),
    (torch.ones(()), ValueError, r"one KL per sequence \(shape \[N\]\); got shape \(\)"),
    (torch.zeros(0), ValueError, "kl_values is empty"),
    (torch.tensor([1.0, math.inf]), ValueError, "kl_values must be finite; got a mean of inf"),
])
def test_sequence_kl_refuses_what_is_not_one_finite_kl_per_sequence(values, error, needle):
    with pytest.raises(error, match=needle):
        sequence_kl(values)


def _controllers():
    return [ConstantKLController(kl_coef=0.1),
            AdaptiveKLController(init_kl_coef=0.15, target=6.0, horizon=10_000),
            TargetKLController(kl_coef=0.1, kl_target=3.0),
            BudgetKLController(kl_coef=0.1, kl_target=3.0)]


def test_step_on_a_reading_equals_update_on_the_torchrl_forms():
    """Two updates each (the target controller's second one uses its trend), bit for bit."""
    for by_update, by_step in zip(_controllers(), _controllers()):
        for kls in (KLS, [9.0, 7.0]):
            assert by_update.update(kls) == by_step.step(sequence_kl(torch.tensor(kls)))
        assert by_update.state_dict() == by_step.state_dict()


def test_adaptive_step_gives_the_spec_check():
    """SPEC 6: beta 0.15, target 6, n = 512, horizon 1e4: KL 12 gives 0.15 * (1 + 0.2 * 512 / 1e4) = 0.151536."""
    ctl = AdaptiveKLController(init_kl_coef=0.15, target=6.0, horizon=10_000)
    assert ctl.step(SequenceKL(12.0, 512)) == pytest.approx(0.151536, rel=1e-12)
