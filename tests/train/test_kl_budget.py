"""``kl_controller=budget`` in the recipe on the tiny float64 model: the KL the move logs is the
KL of the weights kept, under the band's top whenever the budget moved them, in every topology
the step runs in (LoRA and full fine-tuning, the leash in the loss and in the reward, several
updates per rollout, the tool task); weights it does not move stay bit-identical; a resumed
run is bit-identical. The 2-rank parity is in ``test_sharded.py``, Ray in ``tests/ray``."""

from __future__ import annotations

import types

import pytest
import torch

from tests.train.test_recipe import _metrics, _weights, interrupted_train, prepared, tiny_cfg
from tests.train.test_tool_task import cfg as tool_cfg
from tests.train.test_tool_task import scripted_rollout
from tether.control import BudgetKLController
from tether.models.scoring import exact_kl_tokens
from tether.models.records import group_ids
from tether.train.updates import CONFIRM_EVERY, answer_kl, confirm_rows, hold_kl_budget, mark_step_start
from tether.train.recipe import build_run, optimize, train

BUDGET = dict(kl_controller="budget", dtype="float64", learning_rate=1e-2, kl_coef=0.05)


def _moved_away(run, sigma: float = 0.05) -> None:
    """Perturb the trainable weights so the policy starts well away from its reference."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in run.models.policy.parameters():
            if p.requires_grad:
                p.add_(sigma * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _naive_kl(run, record) -> torch.Tensor:
    """``[B]`` the exact KL summed over each answer's tokens, by the two-pass ``exact_kl_tokens``
    (its own reference pass), not the kept hidden states."""
    with torch.no_grad():
        kl = exact_kl_tokens(run.models.policy, run.models.reference, record.tokens, record.attention_mask,
                             where=record.assistant_mask)
    return kl.sum(-1)


@pytest.mark.parametrize("setting", [
    dict(lora_rank=0),
    dict(lora_rank=4),
    dict(lora_rank=0, kl_mode="reward", kl_estimator="k1"),
    dict(lora_rank=4, updates_per_rollout=2),
])
@pytest.mark.parametrize("every", [1, CONFIRM_EVERY])
def test_the_logged_kl_is_the_kept_weights_and_under_the_top(tmp_path, setting, every):
    """After one step from weights moved away from the reference, with a target a tenth of the
    updated weights' KL: the budget pulls them back (scale < 1) and the weights it keeps have a
    naive exact KL within the band's top. The search reads every answer (``confirm_every=1``) or
    every third answer of each group (rows 0 and 3 of two groups of three); either way the KL it
    logs for the weights kept, ``kl_kept_per_seq``, is a reading over every answer: the naive
    mean KL to 1e-10."""
    run = build_run(tiny_cfg(tmp_path / "run", **BUDGET, **setting))
    _moved_away(run)
    record, _ = prepared(run)
    mark_step_start(run)
    optimize(run, record, 0)
    before = _naive_kl(run, record)
    run.controller = BudgetKLController(init_kl_coef=0.05, target=float(before.mean()) / 10, model=run.leash)
    move = hold_kl_budget(run, record, confirm_every=every)
    after = _naive_kl(run, record)
    part = confirm_rows(record, every)
    assert part.tolist() == (list(range(len(record))) if every == 1 else [0, 3])  # 2 groups of 3 answers
    assert move.kl_before == pytest.approx(float(before.mean()), rel=1e-10)
    assert 0 < move.scale < 1 and move.rejected is False
    assert move.kl_kept == pytest.approx(float(after.mean()), rel=1e-10, abs=1e-14)
    assert float(after.mean()) <= 1.25 * float(before.mean()) / 10
    assert 3 <= move.forwards <= 5


def test_confirm_rows_are_every_third_answer_of_each_group_however_the_step_is_split():
    """Four groups of five answers (rows 0-4, 5-9, ...): every third answer of each group is
    its answers 0 and 3, rows 0, 3, 5, 8, 10, 13, 15, 18. Split over two ranks of two groups
    (each rank's local group ids 0, 1), each rank keeps the same answers of its own groups, so
    the ranks' rows, shifted by 10 for the second, are the one process's rows. Groups need not
    be contiguous: interleaved ids keep each group's own first, fourth, ... answer."""
    def record(ids: list[int]) -> types.SimpleNamespace:  # all confirm_rows reads
        return types.SimpleNamespace(group_ids=torch.tensor(ids))

    whole = confirm_rows(record(group_ids(20, 5).tolist()), 3).tolist()
    assert whole == [0, 3, 5, 8, 10, 13, 15, 18]
    half = confirm_rows(record(group_ids(10, 5).tolist()), 3).tolist()
    assert half + [r + 10 for r in half] == whole
    assert confirm_rows(record([0, 1, 0, 1, 0, 1, 0, 1]), 3).tolist() == [0, 1, 6, 7]
    assert confirm_rows(record(group_ids(8, 4).tolist()), 1).tolist() == list(range(8))


def test_weights_are_bit_identical_when_the_budget_does_not_bind(tmp_path):
    """A KL far under a target that may not be pushed toward (max_scale 1): one reading, no move,
    every weight exactly as the optimizer left it."""
    run = build_run(tiny_cfg(tmp_path / "run", **BUDGET, lora_rank=4))
    run.controller = BudgetKLController(init_kl_coef=0.05, target=1e6, max_scale=1.0, model=run.leash)
    record, _ = prepared(run)
    mark_step_start(run)
    optimize(run, record, 0)
    updated = {n: p.detach().clone() for n, p in run.models.policy.named_parameters()}
    move = hold_kl_budget(run, record)
    assert (move.scale, move.forwards) == (1.0, 1)
    assert all(torch.equal(p.detach(), updated[n]) for n, p in run.models.policy.named_parameters())


def test_without_reference_hidden_states_the_budget_reads_k1(tmp_path):
    """A reference that returned log-probs only (Ray's service): ``answer_kl`` is the k1 sum
    ``log pi(y_t) - log pi_ref(y_t)`` over each answer's sampled tokens, by a naive forward."""
    run = build_run(tiny_cfg(tmp_path / "run", **BUDGET))
    _moved_away(run)
    record, _ = prepared(run)
    record.ref_hidden = None
    got = answer_kl(run.actor, record)
    with torch.no_grad():
        logits = run.models.policy(input_ids=record.tokens, attention_mask=record.attention_mask.long()).logits
        logp = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, record.tokens[:, 1:, None])[..., 0]
    k1 = (logp - record.ref_log_probs[:, 1:]) * record.assistant_mask[:, 1:]
    assert torch.allclose(got, k1.sum(-1), rtol=1e-10, atol=1e-12)


def test_other_controllers_without_a_ceiling_do_not_measure(tmp_path):
    run = build_run(tiny_cfg(tmp_path / "run", kl_controller="target", kl_bound=0))
    record, _ = prepared(run)
    assert run.line is None and hold_kl_budget(run, record) is None


def test_a_run_holds_the_top_and_logs_the_move(tmp_path):
    """Eight steps at lr 1e-2 with a target of 0.5 nats: every step the budget moved keeps a KL
    at most 1.25 * 0.5 (read over every answer), beta moves, and the metrics carry the move's entries."""
    train(tiny_cfg(tmp_path / "run", steps=8, kl_target=0.5, prompts_per_step=4, group_size=4, **BUDGET),
          progress=False)
    records = _metrics(tmp_path / "run")
    moved = [r for r in records if r["kl_move_scale"] != 1.0]
    assert moved, [r["kl_move_before_per_seq"] for r in records]
    assert all(r["kl_kept_per_seq"] <= 0.625 + 1e-12 for r in moved if not r["step_rejected"])
    assert len({r["kl_coef"] for r in records}) > 1
    assert all(1 <= r["kl_move_forwards"] <= 4 for r in records)
    for key in ("kl_move_scale", "kl_move_forwards"):
        assert (tmp_path / "run" / "plots" / f"{key}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_is_bit_identical(tmp_path):
    """A 4-step budget run stopped after step 2 and resumed ends with the weights and metrics of
    the uninterrupted run: the controller's beta, integral and exponent travel in the checkpoint."""
    clean = tmp_path / "clean"
    train(tiny_cfg(clean, steps=4, kl_target=0.3, **BUDGET), progress=False)
    cut = tmp_path / "cut"
    interrupted_train(tiny_cfg(cut, steps=4, kl_target=0.3, **BUDGET), after=2)
    train(tiny_cfg(cut, steps=4, kl_target=0.3, **BUDGET), resume=True, progress=False)
    assert _metrics(clean) == _metrics(cut)
    a, b = _weights(clean), _weights(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(r["kl_move_scale"] != 1.0 for r in _metrics(clean))


def test_tool_episodes_are_measured_on_the_assistant_tokens_only(tmp_path):
    """Multi-turn episodes with a tool result inside: the budget's KL is the exact KL summed over
    the assistant mask alone (which excludes the tool's tokens), equal to the naive two-pass one."""
    run = build_run(tool_cfg(tmp_path / "run", prompts_per_step=2, dtype="float64", kl_controller="budget"))
    _moved_away(run, sigma=0.02)
    record, _ = prepared(run, rollout=scripted_rollout)
    tool_rows = record.episode["tool_calls"] > 0
    assert tool_rows.any()
    mark_step_start(run)
    optimize(run, record, 0)
    run.controller = BudgetKLController(init_kl_coef=0.05, target=float(_naive_kl(run, record).mean()) / 4,
                                        model=run.leash)
    move = hold_kl_budget(run, record, confirm_every=1)
    assert move.scale < 1
    assert move.kl_kept == pytest.approx(float(_naive_kl(run, record).mean()), rel=1e-10)
    full = exact_kl_tokens(run.models.policy, run.models.reference, record.tokens, record.attention_mask)
    assert float((full.sum(-1) - (full * record.assistant_mask).sum(-1))[tool_rows].min()) > 0  # tool tokens left out
