"""``reference_move`` in the recipe on the tiny float64 model: the reference moves on the steps
the budget's record says it must, the kept weights' KL to the original model (read naively,
by the two-pass ``exact_kl_tokens``) stays under ``reference_move_budget``, the held-out KL is
measured to the original, a resumed run is bit-identical (moved reference included), and the
bad combinations are refused by name. Each runs fully fine-tuned and with a new LoRA adapter
(``reset`` copies the adapter; the original is the adapter switched off)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.train.test_kl_budget import BUDGET, _moved_away
from tests.train.test_models_devices import IDS, _save_adapter, _tiny_base, _token_logprobs
from tests.train.test_recipe import _metrics, _weights, interrupted_train, prepared, tiny_cfg
from tether.models.reference import AdapterDisabledReference
from tether.models.scoring import exact_kl_tokens
from tether.train.recipe import build_run, train
from tether.train.variants import hold_original_budget, original_model

# A target far under what one update at lr 1e-2 reaches: the budget pulls back every step.
MOVING = dict(**BUDGET, kl_target=0.02, kl_bound=0.0, reference_move="reset", reference_move_after=2)
RANKS = pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])


@RANKS
def test_the_reference_moves_after_each_two_pulled_back_steps_and_resets_to_the_kept_weights(tmp_path, lora_rank):
    """Over 5 steps the logged streaks replayed by hand give the moves: a step counts when
    ``kl_move_scale < 1`` or rejected, and a move clears the streak; ``reference_moves`` is the
    running count. After the run the (reset) reference equals the kept weights of the last step
    that moved it; with a move on the last step, the final policy's."""
    cfg = tiny_cfg(tmp_path / "run", steps=5, lora_rank=lora_rank, **MOVING)
    train(cfg, progress=False)
    rows = _metrics(tmp_path / "run")
    streak, moves = 0, 0
    for row in rows:
        streak = streak + 1 if (row["kl_move_scale"] < 1 or row["step_rejected"]) else 0
        moved = streak == 2
        streak, moves = (0, moves + 1) if moved else (streak, moves)
        assert (row["reference_moved"], row["reference_moves"], row["reference_move_streak"]) == (moved, moves, streak)
    assert moves >= 2  # the plant binds: the test saw moves
    ckpt = tmp_path / "run" / "checkpoints" / (tmp_path / "run" / "checkpoints" / "latest").read_text()
    reference, policy = load_file(str(ckpt / "reference.safetensors")), _weights(tmp_path / "run")
    same = all(torch.equal(reference[k], policy[k]) for k in policy)
    assert same == rows[-1]["reference_moved"]  # a step without a move trains the policy off the reference


@RANKS
def test_the_kept_weights_stay_under_the_budget_to_the_original(tmp_path, lora_rank):
    """After a reset (the reference is the policy) the policy moves away; the cumulative hold
    pulls it back along the line to the original until the naive mean exact KL per answer to the
    original, over every answer, is at most the budget (a tenth of where it was), and logs it to 1e-10.
    With LoRA that line is the adapted weights' own, ``W + s B A``: every ``lora_B`` is scaled by
    the logged scale, bit for bit, and ``lora_A`` is untouched."""
    run = build_run(tiny_cfg(tmp_path / "run", lora_rank=lora_rank, **MOVING))
    record, _ = prepared(run)
    _moved_away(run)
    run.moving.mover.updater.move_now()  # the reference is now the moved policy
    run.moving.mover.moves = 1
    original = run.moving.original

    def naive() -> float:
        with torch.no_grad():
            kl = exact_kl_tokens(run.models.policy, original, record.tokens, record.attention_mask,
                                 where=record.assistant_mask)
        return float(kl.sum(-1).mean())

    start = naive()
    run.moving.budget = start / 10
    factors = {n: p.clone() for n, p in run.models.policy.named_parameters() if p.requires_grad}
    entries = hold_original_budget(run, record, kept=0.0)
    assert entries["kl_to_base_scale"] < 1
    if lora_rank:
        for name, param in run.models.policy.named_parameters():
            if name in factors:
                scaled = factors[name] * entries["kl_to_base_scale"] if "lora_B" in name else factors[name]
                assert torch.equal(param, scaled), name
    assert naive() <= run.moving.budget
    assert entries["kl_to_base_per_seq"] == pytest.approx(naive(), rel=1e-10)
    assert original_model(run) is original and original is not run.models.reference


@RANKS
def test_before_the_first_move_the_reading_is_the_budget_s_own(tmp_path, lora_rank):
    """No move yet: the reference is the original, nothing is read, the policy is not touched."""
    run = build_run(tiny_cfg(tmp_path / "run", lora_rank=lora_rank, **MOVING))
    record, _ = prepared(run)
    _moved_away(run)
    before = [p.clone() for p in run.models.policy.parameters()]
    assert hold_original_budget(run, record, kept=0.7) == {"kl_to_base_per_seq": 0.7, "kl_to_base_scale": 1.0}
    assert all(torch.equal(a, b) for a, b in zip(before, run.models.policy.parameters()))


@RANKS
def test_resume_restores_the_moved_reference_exactly(tmp_path, lora_rank):
    """A 5-step run stopped after step 3 and resumed ends with the weights, the reference and
    the metrics of the uninterrupted run, bit for bit."""
    clean, cut = tmp_path / "clean", tmp_path / "cut"
    cfg = dict(steps=5, lora_rank=lora_rank, **MOVING)
    train(tiny_cfg(clean, **cfg), progress=False)
    interrupted_train(tiny_cfg(cut, **cfg), after=3)
    train(tiny_cfg(cut, **cfg), resume=True, progress=False)
    assert _metrics(clean) == _metrics(cut)
    for name in ("policy", "reference"):
        a, b = (load_file(str(r / "checkpoints" / (r / "checkpoints" / "latest").read_text() / f"{name}.safetensors"))
                for r in (clean, cut))
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("bad, match", [
    (dict(kl_controller="constant"), "needs kl_controller='budget'"),
    (dict(lora_rank=4, reference_move="ema"), "would mix the LoRA factors separately"),
    (dict(reference_update="sync"), "would both move the reference"),
    (dict(kl_bound=4.0, reference_move_budget=2.0), "reference_move_budget: 2 is under kl_bound=4"),
    (dict(reference_move="sometimes"), "reference_move"),
    (dict(reference_move_after=0), "reference_move_after"),
    (dict(reference_move="ema", reference_move_alpha=0.0), "reference_move_alpha"),
])
def test_bad_combinations_are_refused_by_name(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        tiny_cfg(tmp_path / "run", **{**MOVING, **bad}).validate()


ADAPTIVE = dict(**BUDGET, kl_target=0.02, kl_bound=0.0, kl_adaptive_lr=True)


def test_the_learning_rate_follows_the_budget_and_resumes_exactly(tmp_path):
    """Constant schedule, no warm-up: step 1 trains at learning_rate; step k + 1 at learning_rate
    times the multiplier logged at step k, which replays by hand from the logged kept scales
    (x scale when pulled back, x 0.5 when rejected, x 1.5 capped at 1 otherwise). A run stopped
    after step 2 and resumed logs the same lines, bit for bit."""
    clean, cut = tmp_path / "clean", tmp_path / "cut"
    train(tiny_cfg(clean, steps=4, **ADAPTIVE), progress=False)
    rows = _metrics(clean)
    multiplier, base = 1.0, ADAPTIVE["learning_rate"]
    for row in rows:
        assert row["lr"] == pytest.approx(base * multiplier, rel=1e-15)
        factor = 0.5 if row["step_rejected"] else (row["kl_move_scale"] if row["kl_move_scale"] < 1 else 1.5)
        multiplier = min(1.0, multiplier * factor)
        assert row["lr_multiplier"] == pytest.approx(multiplier, rel=1e-15)
    assert rows[-1]["lr"] < base  # the plant binds: the rate moved
    interrupted_train(tiny_cfg(cut, steps=4, **ADAPTIVE), after=2)
    train(tiny_cfg(cut, steps=4, **ADAPTIVE), resume=True, progress=False)
    assert _metrics(cut) == rows


def test_kl_adaptive_lr_needs_the_budget(tmp_path):
    with pytest.raises(ValueError, match="kl_adaptive_lr: the rate follows the budget's kept scale"):
        tiny_cfg(tmp_path / "run", **{**ADAPTIVE, "kl_controller": "target"}).validate()
    with pytest.raises(ValueError, match="kl_adaptive_lr_gain"):
        tiny_cfg(tmp_path / "run", **{**ADAPTIVE, "kl_adaptive_lr_gain": 1.5}).validate()


def test_a_continued_adapter_keeps_the_model_it_loaded_as_the_original(tmp_path):
    """With ``adapter=DIR`` the original is the adapter's model as loaded (a frozen copy: pulling
    back to the base would undo the adapter's earlier training), not the adapter switched off;
    the reference moves in a 5-step run all the same, and every kept step's KL to that original
    is logged under the cumulative budget."""
    _save_adapter(tmp_path / "adapter")
    base, _ = _tiny_base()
    cfg = tiny_cfg(tmp_path / "run", adapter=str(tmp_path / "adapter"), lora_rank=4, steps=5, **MOVING)
    with pytest.warns(UserWarning, match="continuing its LoRA"):
        run = build_run(cfg)
    original = original_model(run)
    assert not isinstance(original, AdapterDisabledReference) and original is not run.models.reference
    loaded = _token_logprobs(run.models.policy, IDS)
    torch.testing.assert_close(_token_logprobs(original, IDS), loaded, rtol=0, atol=1e-12)
    assert (loaded - _token_logprobs(base.double(), IDS)).abs().max() > 1e-2
    with pytest.warns(UserWarning, match="continuing its LoRA"):
        train(cfg, progress=False)
    rows = _metrics(tmp_path / "run")
    assert rows[-1]["reference_moves"] >= 1
    assert all(row["kl_to_base_per_seq"] <= cfg.reference_move_budget for row in rows)
