"""``ReferenceLine``: the budget's move of the weights along the line from the reference.

Float64 tiny models: scaling a LoRA delta equals interpolating the adapted weights, a full
fine-tuning copy interpolates exactly, scale 1 restores the captured weights bit for bit, and
the exact KL to the reference grows monotonically with the scale."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from tests.helpers import make_tiny_model
from tether.models import adapter_disabled, frozen_copy
from tether.control.budget import ReferenceLine
from tether.models.scoring import exact_kl_tokens

IDS = torch.tensor([[257, 72, 105, 258, 10, 65, 66, 67, 68], [257, 200, 3, 4, 5, 6, 258, 9, 11]])


def _lora_policy():
    base = make_tiny_model(dtype=torch.float64)
    return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"],
                                           init_lora_weights=False)).eval()


def _merged(policy) -> dict[str, torch.Tensor]:
    """The adapted weight of every LoRA layer, ``W + scaling * B @ A``, computed by hand."""
    out = {}
    for name, module in policy.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            delta = module.lora_B["default"].weight @ module.lora_A["default"].weight * module.scaling["default"]
            out[name] = module.base_layer.weight.detach() + delta.detach()
    return out


def _full_policy():
    policy = make_tiny_model(dtype=torch.float64, seed=1)
    reference = frozen_copy(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policy, reference


@pytest.mark.parametrize("scale", [0.0, 0.3, 0.71, 1.0, 2.5])
def test_scaling_lora_b_is_interpolating_the_adapted_weights(scale):
    """W + s * scaling * (B A) == W_ref + s * (W_adapted - W_ref), W_ref = W, to 1e-12, and the
    logits match those of a plain model carrying the interpolated weights."""
    policy = _lora_policy()
    before = _merged(policy)
    line = ReferenceLine(policy, adapter_disabled(policy))
    line.capture()
    line.place(scale)
    after = _merged(policy)
    for name, adapted in before.items():
        base = policy.get_submodule(name).base_layer.weight.detach()
        assert torch.allclose(after[name], base + scale * (adapted - base), rtol=0, atol=1e-12), name
    explicit = make_tiny_model(dtype=torch.float64)
    with torch.no_grad():
        for name, weight in after.items():
            explicit.get_submodule(name.removeprefix("base_model.model.")).weight.copy_(weight)
        assert torch.allclose(policy(input_ids=IDS).logits, explicit(input_ids=IDS).logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("scale", [0.0, 0.25, 0.9, 1.7])
def test_full_fine_tuning_interpolates_every_parameter_exactly(scale):
    """Each parameter becomes ref + s * (theta - ref), as torch.lerp computes it, equal in float64
    to the textbook formula to rounding (1e-15 on values of order 1)."""
    policy, reference = _full_policy()
    theta = {n: p.detach().clone() for n, p in policy.named_parameters()}
    ref = dict(reference.named_parameters())
    line = ReferenceLine(policy, reference)
    line.capture()
    line.place(scale)
    for name, param in policy.named_parameters():
        expected = ref[name].detach() + scale * (theta[name] - ref[name].detach())
        assert torch.allclose(param.detach(), expected, rtol=0, atol=1e-15), name
        if scale == 0.0:
            assert torch.equal(param.detach(), ref[name].detach()), name


@pytest.mark.parametrize("make", ["lora", "full"])
def test_scale_one_restores_the_captured_weights_bit_for_bit(make):
    policy, reference = (_lora_policy(), None) if make == "lora" else _full_policy()
    reference = adapter_disabled(policy) if reference is None else reference
    captured = {n: p.detach().clone() for n, p in policy.named_parameters()}
    line = ReferenceLine(policy, reference)
    line.capture()
    for scale in (0.4, 3.0, 0.0, 1.0):
        line.place(scale)
    assert all(torch.equal(p.detach(), captured[n]) for n, p in policy.named_parameters())


@pytest.mark.parametrize("make", ["lora", "full"])
def test_exact_kl_grows_monotonically_with_the_scale(make):
    """On the tiny model the summed exact KL to the reference rises with s over [0, 2], from 0 at s = 0."""
    policy, reference = (_lora_policy(), None) if make == "lora" else _full_policy()
    reference = adapter_disabled(policy) if reference is None else reference
    line = ReferenceLine(policy, reference)
    line.capture()
    mask = torch.ones_like(IDS, dtype=torch.bool)
    kls = []
    for scale in torch.linspace(0, 2, 11).tolist():
        line.place(scale)
        kls.append(float(exact_kl_tokens(policy, reference, IDS, mask).sum()))
    assert kls[0] == pytest.approx(0.0, abs=1e-12)
    assert all(b > a for a, b in zip(kls, kls[1:])), kls


def test_place_before_capture_and_non_lora_trainables_are_refused():
    policy = _lora_policy()
    with pytest.raises(RuntimeError, match="nothing captured; call capture"):
        ReferenceLine(policy, adapter_disabled(policy)).place(0.5)
    policy.get_submodule("base_model.model.lm_head").weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"trainable parameters \['base_model.model.lm_head.weight'\] are not LoRA"):
        ReferenceLine(policy, adapter_disabled(policy))


@pytest.mark.parametrize("scale", [0.3, 0.77, 1.9])
def test_a_bfloat16_line_rounds_once(scale):
    """bfloat16 weights: each point is the float64 interpolation rounded once to bfloat16, within half
    a bfloat16 unit in the last place of the exact value (plus float32's rounding of the operands, which
    matters where the exact point is near 0); arithmetic
    in bfloat16 (three roundings) misses by up to 1.5 units, and moves under one unit vanish."""
    policy = make_tiny_model(dtype=torch.bfloat16, seed=3)
    reference = frozen_copy(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p, dtype=torch.float32).to(torch.bfloat16))
    anchors = {n: p.detach().double() for n, p in reference.named_parameters()}
    values = {n: p.detach().double() for n, p in policy.named_parameters()}
    line = ReferenceLine(policy, reference)
    line.capture()
    line.place(scale)
    for name, param in policy.named_parameters():
        exact = anchors[name] + scale * (values[name] - anchors[name])
        ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
        assert param.dtype == torch.bfloat16
        float32 = 2 ** -23 * (anchors[name].abs() + abs(scale) * (values[name] - anchors[name]).abs())
        assert bool(((param.double() - exact).abs() <= 0.5 * ulp * (1 + 2 ** -8) + float32).all()), name
