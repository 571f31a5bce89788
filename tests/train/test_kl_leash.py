"""The leash in ``tether train``: target controller on the tiny model, both KL signals,
the per-step ``kl_bound`` flag and its count, and exact resume with the controller's state."""

from __future__ import annotations

import json

import pytest
import torch

from tests.train.test_recipe import _metrics, _weights, tiny_cfg
from tether.control import TargetKLController
from tether.train.config import TrainConfig
from tether.train.updates import measure_kl
from tests.train.test_recipe import interrupted_train, prepared
from tether.train.recipe import accumulate_gradients, build_run, train

# lr 1e-2 on the tiny model: at a constant beta 3 its exact KL creeps to about 0.5 nats, at
# beta 0.01 it runs past 4 in 12 steps; a target of 1 nat is reachable only by moving beta.
# 16 answers a step from a random tiny model: the sampled k1 mean is as noisy as the KL is large
# (-0.09 against an exact 0.72 at one step), so the controller reads the exact KL, a step later.
LEASH = dict(learning_rate=1e-2, prompts_per_step=4, group_size=4, checkpoint_every=0, kl_coef=3.0, kl_target=1.0,
             kl_signal="exact", kl_control_signal="exact")


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_target_controller_holds_the_band_where_a_constant_beta_misses_it(tmp_path):
    held = [r["kl_exact_per_seq"] for r in _records_of(tmp_path / "target", "target")][10:]
    fixed = [r["kl_exact_per_seq"] for r in _records_of(tmp_path / "constant", "constant")][10:]
    in_band = [abs(kl - 1.0) <= 0.25 for kl in held]
    assert sum(held) / len(held) == pytest.approx(1.0, rel=0.25), held
    assert sum(in_band) >= 6, held
    assert not any(abs(kl - 1.0) <= 0.25 for kl in fixed), fixed


def _records_of(out, controller: str) -> list[dict]:
    train(tiny_cfg(out, steps=20, kl_controller=controller, **LEASH), progress=False)
    return _records(out)


def test_exact_kl_signal_matches_full_logits(tmp_path):
    """The exact per-answer KL equals sum over response positions of the full-vocabulary KL
    computed naively from both models' logits in float64; the sampled one is the k1 sum."""
    run = build_run(tiny_cfg(tmp_path / "run", steps=2, kl_signal="exact"))
    with torch.no_grad():
        for p in run.models.policy.parameters():  # move the policy away from the reference
            p.add_(0.05 * torch.randn_like(p))
    record, _ = prepared(run)
    terms = accumulate_gradients(run, record)  # the loss pass computes the exact KL on the way
    kl = measure_kl(record.sequence_log_ratio(), terms.kl_to_ref_exact, record.assistant_mask)
    tokens, attn, mask = record.tokens, record.attention_mask, record.assistant_mask
    expected = []
    with torch.no_grad():
        for row in range(tokens.shape[0]):
            ids = tokens[row][attn[row]][None]
            logp = run.models.policy(input_ids=ids).logits.double().log_softmax(-1)[0, :-1]
            logq = run.models.reference(input_ids=ids).logits.double().log_softmax(-1)[0, :-1]
            per_pos = (logp.exp() * (logp - logq)).sum(-1)
            expected.append(float(per_pos[mask[row][attn[row]][1:]].sum()))
    assert kl.exact.tolist() == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert min(expected) > 0
    assert torch.equal(kl.sampled, ((record.sample_log_probs - record.ref_log_probs) * mask).sum(-1).double())
    assert kl.signal is kl.exact


def test_kl_bound_is_a_ceiling_on_the_kept_weights(tmp_path):
    """kl_bound 0.05 under a weak beta: the batches the kept weights sample may read over it (a new
    batch is not the one the weights were kept on), but the kept weights never do: the ceiling
    pulled some step back, no step is flagged, and the summary counts none."""
    out = tmp_path / "run"
    summary = train(tiny_cfg(out, steps=4, kl_bound=0.05, **{**LEASH, "kl_coef": 0.01, "kl_controller": "constant"}),
                    progress=False)
    records = _records(out)
    assert all(r["kl_kept_per_seq"] <= 0.05 for r in records)
    assert any(r["kl_move_scale"] < 1 for r in records)
    assert [r["kl_over_bound"] for r in records] == [False] * 4 and summary["steps_over_kl_bound"] == 0
    assert records[0]["kl_exact_per_seq"] == 0  # step 1: policy == reference
    assert {r["kl_signal"] for r in records} == {"exact"}


def test_target_controller_resumes_bit_exactly(tmp_path):
    kw = dict(steps=5, kl_controller="target", **{**LEASH, "checkpoint_every": 1, "kl_control_signal": "sampled"})
    clean, cut = tmp_path / "clean", tmp_path / "cut"
    train(tiny_cfg(clean, **kw), progress=False)
    interrupted_train(tiny_cfg(cut, **kw), 3)
    state = json.loads((cut / "checkpoints" / (cut / "checkpoints" / "latest").read_text() / "state.json").read_text())
    assert state["controller"]["num_updates"] == 3
    train(TrainConfig.from_yaml(cut / "config.yaml"), resume=True, progress=False)
    assert _metrics(cut) == _metrics(clean)
    assert len({r["kl_coef"] for r in _metrics(clean)}) > 2  # beta really moved
    a, b = _weights(clean), _weights(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kl_mode", ["reward", "loss"])
def test_controller_sets_beta_from_the_sampled_kl_before_the_update(tmp_path, kl_mode):
    """kl_control_signal=sampled: each step's beta (the logged kl_coef, the one its update
    used, in the reward penalty or the loss term) is what a stand-alone controller returns
    when fed that step's sampled KL per answer, so beta acts on the batch it was measured on."""
    out = tmp_path / "run"
    cfg = tiny_cfg(out, steps=6, kl_mode=kl_mode, kl_controller="target",
                   **{**LEASH, "kl_control_signal": "sampled", "kl_estimator": "k3" if kl_mode == "loss" else "k1"})
    train(cfg, progress=False)
    records = _records(out)
    replay = TargetKLController(init_kl_coef=3.0, target=1.0)
    expected = [replay.update(r["kl_per_seq"], n_steps=16) for r in records]
    assert [r["kl_coef"] for r in records] == pytest.approx(expected, rel=1e-9)
    assert len(set(expected)) > 1  # the replay really moved beta


def test_exact_control_needs_the_exact_kl():
    with pytest.raises(ValueError, match="kl_control_signal: 'exact' needs kl_signal='exact'"):
        TrainConfig(kl_signal="sampled", kl_control_signal="exact").validate()


def test_sampled_signal_skips_the_exact_kl(tmp_path):
    """With kl_signal=sampled no exact KL is computed (the reference keeps no hidden states):
    the controller and the bound read the sampled k1 per answer, and the record says so."""
    run = build_run(tiny_cfg(tmp_path / "probe", kl_signal="sampled"))
    record, _ = prepared(run)
    assert record.ref_hidden is None and accumulate_gradients(run, record).kl_to_ref_exact is None
    out = tmp_path / "run"
    summary = train(tiny_cfg(out, steps=3, kl_bound=0.05, **{**LEASH, "kl_signal": "sampled", "kl_controller": "target",
                                                              "kl_control_signal": "sampled", "kl_coef": 0.01}),
                    progress=False)
    records = _records(out)
    assert all("kl_exact_per_seq" not in r and r["kl_signal"] == "sampled" for r in records)
    assert [r["kl_over_bound"] for r in records] == [r["kl_kept_per_seq"] > 0.05 for r in records]
    assert summary["steps_over_kl_bound"] == sum(r["kl_over_bound"] for r in records) == 0
