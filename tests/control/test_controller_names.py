"""One knob, one meaning under both its names: the constructors and ``make_kl_controller`` take
the configuration's spelling (``kl_coef``, ``kl_target``, ``kl_horizon``, as ``tether train``
writes them) and TorchRL's (``init_kl_coef``, ``target``, ``horizon``), and refuse a knob given
twice, or missing, naming both; the factory lists what a controller takes."""

from __future__ import annotations

import pytest
import torch

from tether.control import (
    AdaptiveKLController,
    BudgetKLController,
    ConstantKLController,
    TargetKLController,
    make_kl_controller,
)


@pytest.mark.parametrize("name, cls", [("target", TargetKLController), ("budget", BudgetKLController)])
def test_config_names_build_the_same_controller(name, cls):
    """kl_coef=0.1, kl_target=3.0 is init_kl_coef=0.1, target=3.0: same start, same target,
    same state."""
    by_config = make_kl_controller(name, kl_coef=0.1, kl_target=3.0)
    by_torchrl = cls(init_kl_coef=0.1, target=3.0)
    assert type(by_config) is cls
    assert (by_config.kl_coef, by_config.target) == (0.1, 3.0)
    assert by_config.state_dict() == by_torchrl.state_dict()


def test_adaptive_config_names_follow_the_same_rule():
    """The spec's worked check through the config's names: beta 0.15, target 6, horizon 1e4,
    512 answers at KL 12 -> e = clip(12/6 - 1, -0.2, 0.2) = 0.2, beta = 0.15 * (1 + 0.2 * 512 /
    1e4) = 0.151536."""
    ctl = make_kl_controller("adaptive", kl_coef=0.15, kl_target=6.0, kl_horizon=10_000)
    assert isinstance(ctl, AdaptiveKLController)
    assert ctl.update(torch.full((512,), 12.0)) == pytest.approx(0.151536, abs=1e-12)


def test_constant_takes_either_name_of_its_coefficient():
    assert make_kl_controller("constant", init_kl_coef=0.05).kl_coef == 0.05
    assert isinstance(make_kl_controller("constant", kl_coef=0.05), ConstantKLController)


@pytest.mark.parametrize("kwargs, given", [
    (dict(kl_coef=0.1, init_kl_coef=0.2, target=3.0), r"init_kl_coef=0.2 and kl_coef=0.1"),
    (dict(init_kl_coef=0.1, kl_target=3.0, target=3.0), r"target=3.0 and kl_target=3.0"),
])
def test_one_knob_under_both_names_is_refused(kwargs, given):
    """Both spellings at once would leave one silently unused (even with equal values)."""
    with pytest.raises(TypeError, match=rf"BudgetKLController: {given} are one knob .*give one of them"):
        make_kl_controller("budget", **kwargs)


@pytest.mark.parametrize("cls", [AdaptiveKLController, TargetKLController, BudgetKLController])
def test_constructors_take_the_config_names_and_name_a_missing_knob(cls):
    """Called directly, as a user of the pieces does: the config's names build the controller TorchRL's
    names build; neither name of a knob is a TypeError naming both."""
    extra = {"horizon": 1000.0} if cls is AdaptiveKLController else {}
    assert cls(kl_coef=0.1, kl_target=3.0, **extra).state_dict() == cls(init_kl_coef=0.1, target=3.0, **extra).state_dict()
    with pytest.raises(TypeError, match=rf"{cls.__name__}: target is required \(tether train's config calls it kl_target"):
        cls(kl_coef=0.1, **extra)
    assert ConstantKLController(init_kl_coef=0.3).kl_coef == 0.3


def test_unknown_keyword_lists_both_spellings():
    """The budget has no horizon: the error lists its keywords, both names of each knob among them."""
    with pytest.raises(TypeError, match=r"unknown argument 'horizon'; it takes init_kl_coef, target, model, .*"
                                        r"kl_coef, kl_target"):
        make_kl_controller("budget", init_kl_coef=0.1, target=3.0, horizon=10)
