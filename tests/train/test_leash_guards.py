"""The leash guards the kept weights: a rejected update returns the run to where the step started
(weights and optimizer state, bit for bit), the ceiling ``kl_bound`` holds on the kept weights of
every controller under a learning rate 50x the default, and the config refuses a band whose top
lies over the ceiling. Tiny float64 model; the search itself is in ``tests/control``."""

from __future__ import annotations

import pytest
import torch

from tests.train.test_kl_budget import BUDGET, _moved_away, _naive_kl
from tests.train.test_recipe import _metrics, prepared, tiny_cfg
from tether.control import BudgetKLController
from tether.train.config import TrainConfig
from tether.train.recipe import build_run, optimize, train
from tether.train.updates import hold_kl_budget, mark_step_start


def _state(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()}
            for group in optimizer.param_groups for p in group["params"]]


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k]))
                                                                 for k in x) for x, y in zip(a, b))


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_rejected_update_keeps_the_start_weights_and_optimizer_state(tmp_path, lora_rank):
    """Two steps: the first is kept (it fills Adam's moments), the second is forced to a rejection by
    a search that can only overshoot: one reading after the first (max_forwards 2) with the KL's
    exponent set to 4 where it is about 2, so the guess s = (t / k)^(1/4) reads about sqrt(k t),
    far over the top 1.25 t for t = k / 100. Then every trainable weight and every optimizer
    tensor (moments, step count) is bit for bit what it was before the second update, and the
    kept KL logged is the naive KL of those start weights."""
    run = build_run(tiny_cfg(tmp_path / "run", **BUDGET, lora_rank=lora_rank))
    _moved_away(run)
    run.controller = BudgetKLController(init_kl_coef=0.05, target=1e6, push=False, model=run.leash)
    for step in range(2):
        record, _ = prepared(run, step)
        mark_step_start(run)
        if step == 1:
            weights = {n: p.detach().clone() for n, p in run.models.policy.named_parameters() if p.requires_grad}
            state = _state(run.optimizer)
            start_kl = _naive_kl(run, record).mean()
        optimize(run, record, step)
        if step == 1:
            run.controller = BudgetKLController(init_kl_coef=0.05, target=float(_naive_kl(run, record).mean()) / 100,
                                                max_forwards=2, model=run.leash)
            run.controller.power = 4.0
        move = hold_kl_budget(run, record, confirm_every=1)
    assert move.rejected is True and move.scale == 1.0
    assert all(torch.equal(p.detach(), weights[n]) for n, p in run.models.policy.named_parameters() if p.requires_grad)
    assert _same(_state(run.optimizer), state)
    assert move.kl_kept == pytest.approx(float(start_kl), rel=1e-10)


def test_a_rejection_at_the_first_step_leaves_the_optimizer_unstarted(tmp_path):
    """Rejected before Adam ever stepped: its state is empty again, so the next step is Adam's first."""
    run = build_run(tiny_cfg(tmp_path / "run", **BUDGET))
    _moved_away(run)
    record, _ = prepared(run)
    mark_step_start(run)
    optimize(run, record, 0)
    assert len(run.optimizer.state) > 0
    run.controller = BudgetKLController(init_kl_coef=0.05, target=float(_naive_kl(run, record).mean()) / 100,
                                        max_forwards=2, model=run.leash)
    run.controller.power = 4.0
    assert hold_kl_budget(run, record).rejected is True
    assert len(run.optimizer.state) == 0


@pytest.mark.parametrize("controller", ["constant", "target", "budget"])
def test_no_kept_weights_over_kl_bound_at_fifty_times_the_learning_rate(tmp_path, controller):
    """lr 1e-2 (50x the default 2e-4) and a weak beta drive the KL far up; with kl_bound 0.4 every
    step's kept weights read at most 0.4 over every answer, the ceiling had to act (a kept scale
    under 1 on some step), nothing counts over the bound, and the kept KL of the last step is the
    naive exact KL of the final weights on that step's answers (checked in the budget's tests)."""
    cfg = tiny_cfg(tmp_path / "run", steps=5, prompts_per_step=3, group_size=4, dtype="float64", learning_rate=1e-2,
                   kl_coef=0.01, kl_controller=controller, kl_target=0.2, kl_bound=0.4)
    summary = train(cfg, progress=False)
    records = _metrics(tmp_path / "run")
    assert all(r["kl_kept_per_seq"] <= 0.4 for r in records), [r["kl_kept_per_seq"] for r in records]
    assert any(r["kl_move_scale"] < 1 for r in records)
    assert summary["steps_over_kl_bound"] == 0 and not any(r["kl_over_bound"] for r in records)
    assert summary["steps_rejected"] == sum(r["step_rejected"] for r in records)


def test_a_band_over_the_ceiling_is_refused_and_zero_turns_the_ceiling_off():
    with pytest.raises(ValueError, match=r"kl_bound: the budget may keep weights up to \(1 \+ kl_band\) x kl_target = 5 "
                                         r"nats per answer, above kl_bound = 4; raise kl_bound to at least 5, or lower "
                                         r"kl_target to at most 3.2"):
        TrainConfig(kl_target=4.0).validate()
    TrainConfig(kl_target=4.0, kl_bound=0).validate()
    TrainConfig(kl_target=4.0, kl_bound=5.0).validate()
    with pytest.raises(ValueError, match="kl_max_forwards: expected an int >= 2, got 1"):
        TrainConfig(kl_max_forwards=1).validate()


def test_push_off_never_scales_an_update_out(tmp_path):
    """kl_push=false with a target far over what lr 1e-3 reaches: no kept scale above 1."""
    train(tiny_cfg(tmp_path / "run", steps=3, **{**BUDGET, "learning_rate": 1e-3}, kl_target=3.0, kl_push=False),
          progress=False)
    assert all(r["kl_move_scale"] <= 1 for r in _metrics(tmp_path / "run"))


def test_the_kl_is_measured_and_logged_at_beta_zero(tmp_path):
    """beta = 0 (TRL's default: no KL term): the reference is still scored, so every step logs the
    sampled and exact KL of its batch, the kept weights' KL and the sampler-learner KL; at lr 1e-2 the
    KL leaves 0 after the first update."""
    train(tiny_cfg(tmp_path / "run", steps=3, kl_controller="constant", kl_coef=0.0, learning_rate=1e-2),
          progress=False)
    records = _metrics(tmp_path / "run")
    for key in ("kl_per_seq", "kl_exact_per_seq", "kl_kept_per_seq", "kl_behaviour_per_token"):
        assert all(key in r for r in records), key
    assert all(r["kl_coef"] == 0.0 for r in records) and records[-1]["kl_exact_per_seq"] > 0
