"""The loop knobs of ``tether train``: several updates per rollout, the LR schedule, periodic
evaluation with a best checkpoint, and the loss variants as config fields (issue 13, item 6)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from tests.train.test_recipe import _metrics, _weights, interrupted_train, prepared, tiny_cfg
from tether.objectives import RATIO_LEVELS
from tether.ops import AGGREGATION_MODES, IMPORTANCE_WEIGHT_MODES, TRUST_REGIONS, aggregate_denominator
from tether.train.cli import main
from tether.train.config import TrainConfig
from tether.train import recipe
from tether.train.recipe import build_run, optimize, train
from tether.train.updates import LR_SCHEDULES, lr_multiplier
from tether.train.updates import minibatch_bounds


def _scored_batch(run):
    return prepared(run)[0]


def _per_update(run, batch, update) -> list:
    """The per-token terms of each of the step's updates (``Update.terms`` holds them in order)."""
    bounds = minibatch_bounds(len(batch), run.cfg.updates_per_rollout)
    return [dataclasses.replace(update.terms, **{
        f.name: None if getattr(update.terms, f.name) is None else getattr(update.terms, f.name)[b:e]
        for f in dataclasses.fields(update.terms)}) for b, e in bounds]


def test_one_update_per_rollout_is_bit_identical_to_the_single_update(tmp_path):
    """``updates_per_rollout=1`` takes exactly the one full-batch step of the recipe before the
    option existed, written out here: zero the gradients, backward each micro-batch's loss
    with the full batch's denominator, clip, step. Weights after the step are bit-equal."""
    runs = [build_run(tiny_cfg(tmp_path / f"r{i}", learning_rate=1e-2)) for i in range(2)]
    batches = [_scored_batch(run) for run in runs]
    optimize(runs[0], batches[0], 0)
    run, batch = runs[1], batches[1]
    denominator = aggregate_denominator(batch.assistant_mask, run.cfg.aggregation)
    run.optimizer.zero_grad(set_to_none=True)
    for begin in range(0, len(batch), run.cfg.micro_batch_size):
        terms = recipe.token_terms(run, batch.rows(begin, begin + run.cfg.micro_batch_size))
        recipe.reduce(run, terms, denominator).total_loss().backward()
    params = [p for p in run.models.policy.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, run.cfg.grad_clip)
    run.optimizer.step()
    a, b = (dict(r.models.policy.named_parameters()) for r in runs)
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert any(not torch.equal(a[name], p) for name, p in build_run(tiny_cfg(tmp_path / "r2")).models.policy.named_parameters())


def test_second_update_is_off_policy_so_clip_and_ess_act(tmp_path):
    """With 2 updates the 6 sequences split 3 + 3: the first mini-batch is scored by the weights
    that sampled it (ratio 1 up to rounding), the second after one update (ratio != 1). With a
    tight clip (0.01) and a large step, tokens of the second half clip and the ESS of the
    logged (whole-step) weights falls below 1."""
    run = build_run(tiny_cfg(tmp_path / "run", updates_per_rollout=2, learning_rate=3e-2, clip_epsilon=0.01))
    batch = _scored_batch(run)
    update = optimize(run, batch, 0)
    gaps, logged = [t.ratio_gap for t in _per_update(run, batch, update)], update.output
    assert len(gaps) == 2 and [g.shape[0] for g in gaps] == [3, 3]
    assert float(gaps[0].abs().max()) < 1e-5
    assert float(gaps[1].abs().max()) > 1e-2
    assert float(logged.clip_fraction) > 0 and float(logged.ESS) < 0.999


def test_tis_with_several_updates_uses_the_stored_old_log_probs(tmp_path):
    """With ``importance_correction`` the ratio's denominator is the trainer's log-prob under
    the weights that sampled (``old_log_probs``); without storing them ``GRPOLoss`` would use
    the current policy and every ratio would be 1. The stored values are the policy's own
    scores before the update (equal to the sampling log-probs up to rounding)."""
    run = build_run(tiny_cfg(tmp_path / "run", updates_per_rollout=3, learning_rate=3e-2,
                             importance_correction="tis", importance_cap=3.0))
    batch = _scored_batch(run)
    gaps = [t.ratio_gap for t in _per_update(run, batch, optimize(run, batch, 0))]
    mask = batch.assistant_mask
    torch.testing.assert_close(batch.old_log_probs * mask, batch.sample_log_probs * mask, rtol=0, atol=1e-5)
    assert len(gaps) == 3 and float(gaps[0].abs().max()) < 1e-5
    assert float(gaps[1].abs().max()) > 1e-2 and float(gaps[2].abs().max()) > 1e-2


def test_minibatch_bounds_cover_the_batch_in_order():
    assert minibatch_bounds(6, 1) == [(0, 6)]
    assert minibatch_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert minibatch_bounds(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match=r"updates_per_rollout: expected 1\.\.3.*got 4"):
        minibatch_bounds(3, 4)


def test_lr_multipliers_by_hand():
    """warm-up 2 of 6 steps: (s+1)/3 for s = 0, 1; then p = (s-2)/4 = 0, 1/4, 1/2, 3/4:
    linear 1 - p = 1, .75, .5, .25; cosine (1 + cos(pi p))/2 = 1, .853553, .5, .146447."""
    expected = {
        "constant": [1 / 3, 2 / 3, 1, 1, 1, 1],
        "linear": [1 / 3, 2 / 3, 1, 0.75, 0.5, 0.25],
        "cosine": [1 / 3, 2 / 3, 1, 0.8535533905932737, 0.5, 0.14644660940672627],
    }
    assert set(expected) == set(LR_SCHEDULES)
    for name, values in expected.items():
        got = [lr_multiplier(s, schedule=name, warmup_steps=2, total_steps=6) for s in range(6)]
        assert got == pytest.approx(values, abs=1e-12), name
    with pytest.raises(ValueError, match="lr_schedule: expected one of 'constant'.*, got 'step'"):
        lr_multiplier(0, schedule="step", warmup_steps=0, total_steps=1)


def test_cosine_schedule_is_logged_and_resumes_bit_exact(tmp_path):
    """A 4-step cosine run with 1 warm-up step logs lr = 1e-2 * (1/2, 1, (1+cos(pi/3))/2 = .75,
    (1+cos(2pi/3))/2 = .25); a run cut after step 2 and resumed ends bit-identical."""
    kw = dict(steps=4, lr_schedule="cosine", warmup_steps=1, learning_rate=1e-2, checkpoint_every=2)
    clean = tmp_path / "clean"
    train(tiny_cfg(clean, **kw), progress=False)
    lrs = [r["lr"] for r in _metrics(clean)]
    assert lrs == pytest.approx([5e-3, 1e-2, 7.5e-3, 2.5e-3], rel=1e-12)
    cut = tmp_path / "cut"
    interrupted_train(tiny_cfg(cut, **kw), 3)
    state = json.loads((cut / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["lr_scheduler"]["last_epoch"] == 2
    train(TrainConfig.from_yaml(cut / "config.yaml"), resume=True, progress=False)
    assert _metrics(cut) == _metrics(clean)
    a, b = _weights(clean), _weights(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_eval_every_keeps_the_best_checkpoint(tmp_path, capsys):
    """Every 2 of 6 steps the held-out accuracy is logged; best/ holds the checkpoint of the
    first step reaching the maximum, with the weights of that step (equal to the regular
    checkpoint of the same step), and ``tether eval --best`` scores it."""
    run = tmp_path / "run"
    # The target controller (under the budget's push the run is right on every problem by step 2),
    # and a rate and seed whose held-out accuracy moves (0.75, 1, 1): the tiny task starts at 1.0
    # for most seeds, so a best checkpoint would mean nothing there.
    summary = train(tiny_cfg(run, steps=6, eval_every=2, learning_rate=1e-1, keep_checkpoints=6,
                             kl_controller="target", seed=2), progress=False)
    records = _metrics(run)
    evals = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}
    assert sorted(evals) == [2, 4, 6] and len(set(evals.values())) > 1, evals  # a best that means something
    best_step = min(s for s, a in evals.items() if a == max(evals.values()))
    assert (summary["best_eval_step"], summary["best_eval_accuracy"]) == (best_step, evals[best_step])
    kept = sorted(p.name for p in (run / "best" / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept == [f"step_{best_step:06d}"]
    from safetensors.torch import load_file

    best = load_file(str(run / "best" / "checkpoints" / kept[0] / "policy.safetensors"))
    regular = load_file(str(run / "checkpoints" / kept[0] / "policy.safetensors"))
    assert all(torch.equal(best[k], regular[k]) for k in regular)
    capsys.readouterr()
    assert main(["eval", str(run), "--best", "--trust-task-code"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 4


@pytest.mark.parametrize("overrides,fragment", [
    ({"updates_per_rollout": 7}, "updates_per_rollout: expected 1..6"),
    ({"warmup_steps": 4}, "warmup_steps: 4 is more than steps (3)"),
    ({"dual_clip": 0.5}, "dual_clip: expected a finite number > 1, got 0.5. 0 turns it off."),
    ({"importance_cap": 0.0}, "importance_cap: expected a finite number > 0, got 0.0"),
    ({"lr_schedule": "step"}, "lr_schedule: expected one of 'constant', 'linear', 'cosine', got 'step'."),
    ({"report_to": "tensorboard,wand"}, "report_to: expected one of 'none', 'tensorboard', 'wandb', 'mlflow', got 'wand'."),
    ({"ratio_level": "seq"}, "ratio_level: expected one of 'token', 'sequence', got 'seq'."),
    ({"importance_correction": "is"}, "importance_correction: expected one of 'tis', 'mis', 'none', got 'is'."),
    ({"eval_every": -1}, "eval_every: expected an int >= 0, got -1"),
    ({"kl_correction": "raw"}, "kl_correction: expected one of 'importance', 'none', got 'raw'."),
    ({"trust_region": "tv"}, "trust_region: expected one of 'clip', 'none', 'dppo_tv', 'dppo_kl', got 'tv'."),
    ({"trust_region": "dppo_tv", "trust_region_delta_high": 1.0},
     "trust_region_delta_high: trust_region='dppo_tv' needs a probability shift in (0, 1), got 1.0."),
    ({"trust_region_delta": 0.0}, "trust_region_delta: expected a finite number > 0, got 0.0"),
    ({"trust_region_delta_high": -0.1}, "trust_region_delta_high: expected a finite number >= 0, got -0.1"),
])
def test_loop_config_errors_name_the_key(tmp_path, overrides, fragment):
    with pytest.raises(ValueError) as err:
        tiny_cfg(tmp_path / "run", **overrides).validate()
    assert fragment in str(err.value)


def test_config_choices_are_the_registries():
    from tether.train.config import config_choices

    choices = config_choices()
    assert choices["aggregation"] is AGGREGATION_MODES and choices["ratio_level"] is RATIO_LEVELS
    assert set(choices["importance_correction"]) == {"none", *IMPORTANCE_WEIGHT_MODES}
    assert choices["trust_region"] is TRUST_REGIONS


def test_loss_variants_reach_the_loss(tmp_path):
    """The config's loss variants reach the recipe's loss (tests/train/test_recipe_loss.py holds
    each equal to GRPOLoss's). GSPO's sequence ratio clips whole rows: in the off-policy second
    update every valid token of a row is clipped or none is (per-row advantage), and with a
    tight clip some row is."""
    cfg = tiny_cfg(tmp_path / "run", ratio_level="sequence", dual_clip=3.0, importance_correction="mis",
                   importance_cap=2.5, aggregation="seq-mean-token-sum", updates_per_rollout=2, learning_rate=3e-2,
                   clip_epsilon=0.002)
    run = build_run(cfg)
    batch = _scored_batch(run)
    second = _per_update(run, batch, optimize(run, batch, 0))[1]
    rows = [clipped[m] for clipped, m in zip(second.clipped, second.mask)]
    assert all(bool((r == r[0]).all()) for r in rows if r.numel())
    assert any(bool(r.all()) and r.numel() for r in rows)
    assert math.isfinite(float(second.policy.sum()))


def test_the_spent_gradients_are_dropped_after_the_updates(tmp_path):
    """After the step's updates no trainable weight holds a gradient: kept, they would stay resident
    beside the budget's copies through its readings and the next step's sampling (one more copy of
    the trainable weights). The updates took them first: both mini-batches moved the weights."""
    run = build_run(tiny_cfg(tmp_path / "run", updates_per_rollout=2, learning_rate=1e-2))
    before = {n: p.detach().clone() for n, p in run.models.policy.named_parameters() if p.requires_grad}
    optimize(run, _scored_batch(run), 0)
    trained = {n: p for n, p in run.models.policy.named_parameters() if p.requires_grad}
    assert trained and all(p.grad is None for p in trained.values())
    assert all(not torch.equal(before[n], p) for n, p in trained.items() if "lora_B" in n or "lora" not in n)
    assert run.optimizer.state[next(iter(trained.values()))]["step"] == 2
