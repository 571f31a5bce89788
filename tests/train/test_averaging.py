"""``weight_average`` and ``final_kl_target`` (tether.train.averaging): the running average by hand,
the end interpolation on the line to the reference landing the naive KL at or under its target,
the averaged weights held to the budget's band, both finishes in 2-step runs derived from the
plain run's checkpoints, an exact resume with the average, and the bad settings refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.train.test_kl_budget import BUDGET, _moved_away, _naive_kl
from tests.train.test_recipe import _metrics, _weights, interrupted_train, prepared, tiny_cfg
from tether.control.budget import ReferenceLine
from tether.train.averaging import LAND_BAND, WeightAverage, finish_step, land_on_target
from tether.train.recipe import build_run, train

# Constant beta, no ceiling: nothing moves the weights but the optimizer, so a run is the plain run.
PLAIN = dict(kl_controller="constant", dtype="float64", learning_rate=1e-2, kl_coef=0.05, kl_bound=0.0)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_the_average_by_hand():
    """mu = 3/4 from w0 = (4, -8): after w1 = (8, 0) the average is 0.75 w0 + 0.25 w1 = (5, -6);
    after w2 = (1, 16) it is 0.75 (5, -6) + 0.25 (1, 16) = (4, -1/2); ``apply`` writes it into the
    weights. Every value is a dyadic rational, so float64 holds them exactly. A frozen parameter
    is neither averaged nor written; a bfloat16 weight is averaged in float32."""
    toy = nn.Linear(2, 1).double()
    toy.bias.requires_grad_(False)
    with torch.no_grad():
        toy.weight.copy_(torch.tensor([[4.0, -8.0]]))
        toy.bias.fill_(7.0)
    average = WeightAverage(toy, 0.75)
    assert set(average.average) == {"weight"}
    for w in ([8.0, 0.0], [1.0, 16.0]):
        with torch.no_grad():
            toy.weight.copy_(torch.tensor([w]))
        average.observe()
    assert torch.equal(average.average["weight"], torch.tensor([[4.0, -0.5]], dtype=torch.float64))
    average.apply()
    assert torch.equal(toy.weight, torch.tensor([[4.0, -0.5]], dtype=torch.float64)) and toy.bias.item() == 7.0
    assert WeightAverage(nn.Linear(2, 1).bfloat16(), 0.5).average["weight"].dtype == torch.float32


def test_a_saved_average_that_does_not_fit_is_refused_by_path(tmp_path):
    average = WeightAverage(nn.Linear(2, 1), 0.5)
    save_file({"weight": torch.zeros(1, 3)}, str(tmp_path / "average.safetensors"))
    with pytest.raises(ValueError, match="average.safetensors: the saved average does not fit"):
        average.load(tmp_path / "average.safetensors")


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_end_interpolation_lands_at_or_under_its_target_on_the_line(tmp_path, lora_rank):
    """Weights moved away, a target a quarter of their naive KL: the search keeps a lambda whose
    naive mean KL per answer is in the band under the target ((1 - b/2) / (1 + b/2) of it to 1),
    reported to 1e-10, and the weights are theta_0 + lambda (theta_T - theta_0): for full fine-tuning
    each parameter against the reference's, for LoRA ``lora_B`` scaled (the adapted weights'
    line) and ``lora_A`` untouched. A target above the KL keeps lambda = 1, bit for bit."""
    run = build_run(tiny_cfg(tmp_path / "run", **PLAIN, lora_rank=lora_rank))
    _moved_away(run)
    record, _ = prepared(run)
    line = ReferenceLine(run.models.policy, run.models.reference)
    start, kl_start = _snapshot(run.models.policy), float(_naive_kl(run, record).mean())
    kept = land_on_target(run, record, line, 2 * kl_start)
    assert (kept.scale, kept.kl_kept) == (1.0, pytest.approx(kl_start, rel=1e-10))
    assert all(torch.equal(start[n], p) for n, p in _snapshot(run.models.policy).items())
    target = kl_start / 4
    move = land_on_target(run, record, line, target)
    lam, kl = move.scale, move.kl_kept
    naive = float(_naive_kl(run, record).mean())
    assert (1 - LAND_BAND / 2) / (1 + LAND_BAND / 2) * target <= naive <= target and 0 < lam < 1
    assert kl == pytest.approx(naive, rel=1e-10)
    anchors = dict(run.models.reference.named_parameters()) if not lora_rank else {}
    for name, param in _snapshot(run.models.policy).items():
        if lora_rank:
            want = lam * start[name] if "lora_B" in name else start[name]
        else:
            want = anchors[name] + lam * (start[name] - anchors[name])
        torch.testing.assert_close(param, want, rtol=0, atol=1e-14)


def test_the_averaged_weights_are_held_to_the_budget_s_band(tmp_path):
    """An average far from the reference (the moved weights, observed with themselves: it stays
    them exactly) at a budget target of 0.02: after the last step it replaces the weights, reads
    over the band's top 0.02 x 1.125 and is pulled back along the line to the reference until a
    naive reading is under it; the logged KL is that reading to 1e-10, the weights the scaled line."""
    run = build_run(tiny_cfg(tmp_path / "run", **BUDGET, kl_target=0.02, kl_bound=0.0, weight_average=0.5, steps=1))
    _moved_away(run)
    record, _ = prepared(run)
    moved = _snapshot(run.models.policy)
    run.average.average = {n: v.clone() for n, v in moved.items()}
    with torch.no_grad():  # the policy elsewhere: the finish must write the average, not keep these
        for p in run.average.params.values():
            p.mul_(0.5)
    run.average.mu = 1.0  # observe keeps the average: mu avg + 0 theta
    out = finish_step(run, record, step=0)
    naive = float(_naive_kl(run, record).mean())
    assert out["weight_average_scale"] < 1 and naive <= 0.02 * 1.125
    assert out["weight_average_kl_per_seq"] == pytest.approx(naive, rel=1e-10)
    anchors = dict(run.models.reference.named_parameters())
    for name, param in _snapshot(run.models.policy).items():
        want = anchors[name] + out["weight_average_scale"] * (moved[name] - anchors[name])
        torch.testing.assert_close(param, want, rtol=0, atol=1e-14)


def _checkpoint(run_dir, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "policy.safetensors"))


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_two_step_run_ends_on_the_average_of_its_kept_weights(tmp_path, lora_rank):
    """mu = 1/2, no leash on the weights: avg_1 = (theta_0 + theta_1) / 2, avg_2 = (avg_1 + theta_2) / 2
    = theta_0 / 4 + theta_1 / 4 + theta_2 / 2, with theta_k the plain run's checkpoints (the
    average never feeds back into training) and theta_0 the policy as built: every weight with
    full fine-tuning, both LoRA factors with an adapter. The run's final checkpoint holds the
    average; its metrics before the finish are the plain run's."""
    plain, averaged, setting = tmp_path / "plain", tmp_path / "avg", {**PLAIN, "lora_rank": lora_rank}
    train(tiny_cfg(plain, steps=2, keep_checkpoints=3, **setting), progress=False)
    summary = train(tiny_cfg(averaged, steps=2, weight_average=0.5, **setting), progress=False)
    theta0 = _snapshot(build_run(tiny_cfg(tmp_path / "fresh", **setting)).models.policy)
    theta1, theta2, final = _checkpoint(plain, 1), _checkpoint(plain, 2), _weights(averaged)
    assert not any(torch.equal(theta2[n], final[n]) for n in final)  # the finish moved them
    for name in final:
        torch.testing.assert_close(final[name], theta0[name] / 4 + theta1[name] / 4 + theta2[name] / 2,
                                   rtol=0, atol=1e-14)
    assert _metrics(plain) == _metrics(averaged) and "weight_average_scale" not in summary  # no leash, no reading


def test_a_two_step_run_ends_on_the_interpolation_at_its_target(tmp_path):
    """final_kl_target 1e-3 after 2 steps of constant beta 0: the final weights are
    theta_0 + lambda (theta_T - theta_0) with theta_T the plain run's last checkpoint, theta_0 the
    reference, lambda the summary's ``final_interpolation``, and the landed KL is at most the target."""
    plain, landed = tmp_path / "plain", tmp_path / "land"
    cfg = {**PLAIN, "kl_coef": 0.0}
    train(tiny_cfg(plain, steps=2, **cfg), progress=False)
    summary = train(tiny_cfg(landed, steps=2, final_kl_target=1e-3, **cfg), progress=False)
    lam, theta0 = summary["final_interpolation"], _snapshot(build_run(tiny_cfg(tmp_path / "fresh", **cfg)).models.policy)
    assert 0 < lam < 1 and 0 < summary["final_kl_per_seq"] <= 1e-3
    assert summary["units"]["final_interpolation"].startswith("lambda")
    theta_t, final = _weights(plain), _weights(landed)
    for name in final:
        torch.testing.assert_close(final[name], theta0[name] + lam * (theta_t[name] - theta0[name]), rtol=0, atol=1e-14)


def test_a_resumed_run_keeps_its_average_bit_for_bit(tmp_path):
    """4 steps with the budget and the average, stopped after step 2 and resumed: the final
    weights (the average, held to the band) and every metrics line equal the unstopped run's."""
    clean, cut = tmp_path / "clean", tmp_path / "cut"
    setting = dict(**BUDGET, kl_target=0.05, weight_average=0.5, steps=4)
    train(tiny_cfg(clean, **setting), progress=False)
    interrupted_train(tiny_cfg(cut, **setting), after=2)
    train(tiny_cfg(cut, **setting), resume=True, progress=False)
    assert _metrics(clean) == _metrics(cut) and "weight_average_kl_per_seq" in _metrics(clean)[-1]
    a, b = _weights(clean), _weights(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("bad, match", [
    (dict(weight_average=1.0), r"weight_average: expected a finite number in \[0, 1\), got 1.0"),
    (dict(weight_average=-0.5), "weight_average: expected"),
    (dict(final_kl_target=-1.0), "final_kl_target: expected"),
    (dict(final_kl_target=5.0, kl_bound=4.0), "final_kl_target: 5 is above kl_bound=4"),
    (dict(weight_average=0.8, reference_update="sync"), "weight_average=0.8: the finish is held to the reference"),
    (dict(final_kl_target=1.0, kl_controller="budget", reference_move="reset"), "final_kl_target=1: the finish"),
    (dict(weight_average=0.8, nproc=2), r"run in one process \(nproc=1\), got nproc=2"),
])
def test_bad_settings_are_refused_by_name(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        tiny_cfg(tmp_path / "run", **{**PLAIN, **bad}).validate()
