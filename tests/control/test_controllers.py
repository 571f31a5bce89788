"""KL controllers: the Ziegler et al. update by hand, bounds, validation, state and driven objects."""

from __future__ import annotations

import math

import pytest
import torch

from tether.control import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    ConstantKLController,
    TargetKLController,
    make_kl_controller,
)


class Leashed:
    """Stand-in for any component with a read/write ``kl_coef`` property."""

    def __init__(self) -> None:
        self._coef = -1.0
        self.writes = 0

    @property
    def kl_coef(self) -> float:
        return self._coef

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        self._coef = value
        self.writes += 1


class ReadOnly:
    @property
    def kl_coef(self) -> float:
        return 0.1


def spec_controller(**kwargs) -> AdaptiveKLController:
    return AdaptiveKLController(init_kl_coef=0.15, target=6.0, horizon=1e4, **kwargs)


@pytest.mark.parametrize(
    ("kl", "expected"),
    [(3.0, 0.148464), (6.0, 0.15), (12.0, 0.151536)],
)
def test_adaptive_worked_check_of_the_spec(kl, expected):
    """SPEC section 6. With beta=0.15, target 6, n=512, horizon 1e4:

    KL 3 -> e = clip(3/6 - 1) = -0.2 (clipped from -0.5), beta = 0.15 * (1 - 0.2*0.0512) = 0.148464;
    KL 6 -> e = 0, beta unchanged; KL 12 -> e = clip(1) = 0.2, beta = 0.15 * 1.01024 = 0.151536.
    The three accepted input forms must agree.
    """
    per_sequence = torch.full((512,), kl, dtype=torch.float64)
    forms = [
        lambda c: c.update(per_sequence),
        lambda c: c.update([kl] * 512),
        lambda c: c.update(kl, n_steps=512),
        lambda c: c.update(torch.tensor(kl, dtype=torch.float64), n_steps=512),
    ]
    for form in forms:
        ctl = spec_controller()
        result = form(ctl)
        assert type(result) is float and type(ctl.kl_coef) is float
        assert result == pytest.approx(expected, abs=1e-12)
        assert ctl.kl_coef == result


def test_adaptive_uses_mean_of_per_sequence_sums_and_counts_sequences():
    """Per-sequence KLs [2, 10, 4, 8] have mean 6 = target, so beta must not move (a per-token
    mean or a sum would move it). Then 100 sequences with mean 7.2 (e = 0.2) and horizon 1e4:
    beta = 0.15 * (1 + 0.2 * 100 / 1e4) = 0.1503."""
    ctl = spec_controller()
    assert ctl.update(torch.tensor([2.0, 10.0, 4.0, 8.0])) == pytest.approx(0.15, abs=1e-15)
    kls = torch.linspace(6.2, 8.2, 100, dtype=torch.float64)  # mean 7.2 -> e = 7.2/6 - 1 = 0.2
    assert ctl.update(kls) == pytest.approx(0.15 * (1 + 0.2 * 100 / 1e4), abs=1e-15)


def test_adaptive_proportional_error_inside_the_clip():
    """KL 6.6 -> e = 0.1 (not clipped): beta = 0.15 * (1 + 0.1 * 512 / 1e4) = 0.150768."""
    assert spec_controller().update(6.6, n_steps=512) == pytest.approx(0.150768, abs=1e-12)


def test_adaptive_bounds_are_kept():
    """max_coef caps growth, min_coef stops decay; the default floor 1e-6 lets beta recover."""
    capped = spec_controller(max_coef=0.151)
    for _ in range(3):
        assert capped.update(12.0, n_steps=512) == 0.151
    floored = spec_controller(min_coef=0.149)
    assert floored.update(0.0, n_steps=512) == 0.149
    # n/horizon = 4.5: each low-KL update multiplies by 1 - 0.2*4.5 = 0.1 until the 1e-6 floor.
    fast = AdaptiveKLController(init_kl_coef=0.15, target=6.0, horizon=100)
    for _ in range(8):
        fast.update(0.0, n_steps=450)
    assert fast.kl_coef == 1e-6
    assert fast.update(12.0, n_steps=450) == pytest.approx(1e-6 * 1.9, rel=1e-12)


def test_constant_controller_never_moves():
    target = Leashed()
    ctl = ConstantKLController(kl_coef=0.2, model=target)
    assert target.kl_coef == 0.2 and target.writes == 1
    assert ctl.update(torch.full((8,), 100.0)) == 0.2
    assert ctl.update() == 0.2
    assert target.kl_coef == 0.2 and target.writes == 3


def test_controllers_drive_one_or_several_objects():
    """The initial coefficient is written at construction and each update is pushed to all."""
    reward_side, loss_side = Leashed(), Leashed()
    ctl = spec_controller(model=[reward_side, loss_side])
    assert reward_side.kl_coef == loss_side.kl_coef == 0.15
    new = ctl.update(12.0, n_steps=512)
    assert reward_side.kl_coef == loss_side.kl_coef == new == pytest.approx(0.151536, abs=1e-12)
    single = Leashed()
    spec_controller(model=single).update(3.0, n_steps=512)
    assert single.kl_coef == pytest.approx(0.148464, abs=1e-12)


def test_controller_drives_a_kl_reward_transform():
    from tensordict.nn import ProbabilisticTensorDictModule

    from tether.transforms import KLRewardTransform

    actor = ProbabilisticTensorDictModule(
        in_keys=["loc", "scale"], out_keys=["action"],
        distribution_class=torch.distributions.Normal, return_log_prob=True,
    )
    transform = KLRewardTransform(actor, coef=1.0)
    ctl = spec_controller(model=transform)
    assert transform.kl_coef == 0.15
    ctl.update(12.0, n_steps=512)
    assert transform.kl_coef == pytest.approx(0.151536, abs=1e-12)


@pytest.mark.parametrize("model", [object(), [Leashed(), object()]])
def test_model_without_kl_coef_is_refused(model):
    with pytest.raises(TypeError, match="kl_coef"):
        spec_controller(model=model)
    with pytest.raises(TypeError, match="kl_coef"):
        ConstantKLController(kl_coef=0.1, model=model)


def test_read_only_kl_coef_is_refused():
    with pytest.raises(TypeError, match="read-only"):
        spec_controller(model=ReadOnly())


@pytest.mark.parametrize(
    ("kwargs", "error", "argument"),
    [
        ({"target": 0.0}, ValueError, "target"),
        ({"target": -1.0}, ValueError, "target"),
        ({"target": math.nan}, ValueError, "target"),
        ({"target": "6"}, TypeError, "target"),
        ({"horizon": 0}, ValueError, "horizon"),
        ({"horizon": -5}, ValueError, "horizon"),
        ({"min_coef": -0.1}, ValueError, "min_coef"),
        ({"max_coef": 0.1}, ValueError, "init_kl_coef"),
        ({"min_coef": 0.2}, ValueError, "init_kl_coef"),
        ({"init_kl_coef": 0.0}, ValueError, "init_kl_coef"),
        ({"init_kl_coef": True}, TypeError, "init_kl_coef"),
        ({"max_coef": math.nan}, ValueError, "max_coef"),
    ],
)
def test_adaptive_constructor_validation(kwargs, error, argument):
    arguments = {"init_kl_coef": 0.15, "target": 6.0, "horizon": 1e4, **kwargs}
    with pytest.raises(error, match=argument):
        AdaptiveKLController(**arguments)


@pytest.mark.parametrize("kl_coef", [-0.1, math.inf, "0.1", None])
def test_constant_constructor_validation(kl_coef):
    with pytest.raises((ValueError, TypeError), match="kl_coef"):
        ConstantKLController(kl_coef=kl_coef)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "needle"),
    [
        ((None,), {}, ValueError, "kl_values"),
        ((torch.ones(4, 8),), {}, ValueError, "one KL per sequence"),
        (([],), {}, ValueError, "empty"),
        ((6.0,), {}, ValueError, "n_steps"),
        (([6.0, 6.0],), {"n_steps": 3}, ValueError, "n_steps"),
        ((6.0,), {"n_steps": 0}, ValueError, "n_steps"),
        ((6.0,), {"n_steps": 2.5}, TypeError, "n_steps: expected an int >= 1, got 2.5 of type float"),
        ((6.0,), {"n_steps": 60_000}, ValueError, "horizon"),
        (([6.0, math.nan],), {}, ValueError, "finite"),
        (("six",), {}, TypeError, "kl_values"),
        (([object()],), {}, TypeError, "kl_values"),
    ],
)
def test_adaptive_update_validation(args, kwargs, error, needle):
    ctl = spec_controller()
    with pytest.raises(error, match=needle):
        ctl.update(*args, **kwargs)
    assert ctl.kl_coef == 0.15  # a refused update leaves the state alone


def test_state_round_trip_is_exact():
    ctl = spec_controller(min_coef=1e-3, max_coef=2.0)
    for kl in (3.0, 12.0, 7.1, 5.3):
        ctl.update(torch.full((64,), kl))
    state = ctl.state_dict()
    assert all(type(v) is float for v in state.values())
    target = Leashed()
    restored = AdaptiveKLController(init_kl_coef=1.0, target=1.0, horizon=1.0, model=target)
    restored.load_state_dict(state)
    assert restored.state_dict() == state and target.kl_coef == state["kl_coef"]
    assert restored.update(9.0, n_steps=64) == ctl.update(9.0, n_steps=64)

    constant = ConstantKLController(kl_coef=0.3)
    other = ConstantKLController(kl_coef=0.0)
    other.load_state_dict(constant.state_dict())
    assert other.state_dict() == {"kl_coef": 0.3}


def test_load_state_dict_refuses_wrong_keys():
    ctl = spec_controller()
    with pytest.raises(KeyError, match="horizon"):
        ctl.load_state_dict({"kl_coef": 0.1, "target": 6.0})
    with pytest.raises(KeyError, match="kl_coef"):
        ConstantKLController(kl_coef=0.1).load_state_dict({"coef": 0.1})
    with pytest.raises(ValueError, match="target"):
        ctl.load_state_dict({**ctl.state_dict(), "target": -1.0})


def test_registry_builds_by_name_and_lists_names_on_error():
    assert set(KL_CONTROLLERS) == {"constant", "adaptive", "target", "budget"}
    ctl = make_kl_controller("adaptive", init_kl_coef=0.15, target=6.0, horizon=1e4)
    assert isinstance(ctl, AdaptiveKLController)
    assert isinstance(make_kl_controller("constant", kl_coef=0.1), ConstantKLController)
    assert isinstance(make_kl_controller("target", init_kl_coef=0.2, target=2.0), TargetKLController)
    with pytest.raises(ValueError, match="name: expected one of 'constant', 'adaptive', 'target', 'budget', got 'pid'"):
        make_kl_controller("pid")
    with pytest.raises(ValueError, match="got \\['target'\\]"):  # an unhashable name: the same error
        make_kl_controller(["target"])
