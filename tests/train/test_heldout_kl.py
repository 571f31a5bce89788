"""What the leash promises off the training batches: the held-out KL of answers sampled at the
training temperature (``eval_kl_sampled_per_seq``), against a naive full-logit computation on the
same draws; the run's own generator untouched by it; the sampler-learner KL of a step."""

from __future__ import annotations

import pytest
import torch

from tests.train.test_kl_budget import _moved_away
from tests.train.test_recipe import _metrics, prepared, tiny_cfg
from tether.models import TransformersWrapper
from tether.train.metrics import sampled_kl
from tether.train.recipe import build_run, optimize, train
from tether.train.tasks import prompt_batch
from tether.train.updates import behaviour_kl


def _naive(run, td, temperature: float) -> torch.Tensor:
    """``[B]`` sum over each answer's tokens t of KL(pi(.|y_<t) || pi_ref(.|y_<t)), from full logits."""
    tokens, mask = td["tokens", "full"], td["masks", "all_attention_mask"].long()
    where = td["masks", "all_assistant_mask"].bool()
    with torch.no_grad():
        logp = torch.log_softmax(run.models.policy(input_ids=tokens, attention_mask=mask).logits.double() / temperature, -1)
        logq = torch.log_softmax(run.models.reference(input_ids=tokens, attention_mask=mask).logits.double() / temperature, -1)
    per_position = (logp.exp() * (logp - logq)).sum(-1)  # position t-1 predicts token t
    return (per_position[:, :-1] * where[:, 1:]).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_heldout_kl_is_the_exact_kl_of_fresh_samples(tmp_path, temperature):
    """Weights moved off the reference: ``sampled_kl`` equals the naive mean KL per answer of the
    answers its seed draws (float64 weights; 1e-7, as the packed and the padded forward round
    differently at ~1e-9 here), those answers are samples (not the greedy ones), and
    the run's training generator is where it was."""
    run = build_run(tiny_cfg(tmp_path / "run", dtype="float64", temperature=temperature, eval_size=6))
    _moved_away(run, sigma=0.05)
    generator_state = run.generator.get_state()
    got = sampled_kl(run.models.policy, run.models.reference, run.models.tokenizer, run.task, run.held_out,
                     max_new_tokens=6, temperature=temperature, prompt_format="chat", seed=11)
    assert torch.equal(run.generator.get_state(), generator_state)
    draw = TransformersWrapper(run.models.policy, run.models.tokenizer, input_mode="history", generate=True,
                               temperature=temperature, generate_kwargs={
                                   "max_new_tokens": 6, "generator": torch.Generator().manual_seed(11)})
    td = draw(prompt_batch(run.held_out, "chat"))
    assert got == pytest.approx(float(_naive(run, td, temperature).mean()), rel=1e-7)
    greedy = TransformersWrapper(run.models.policy, run.models.tokenizer, input_mode="history", generate=True,
                                 temperature=temperature, generate_kwargs={"max_new_tokens": 6, "do_sample": False})
    assert not torch.equal(greedy(prompt_batch(run.held_out, "chat"))["tokens", "full"], td["tokens", "full"])


def test_the_summary_keeps_both_heldout_kls_and_periodic_evaluations_log_the_sampled_one(tmp_path):
    """A 2-step run with eval_every 1: each step's record carries ``eval_kl_sampled_per_seq`` (0 is
    impossible once the weights moved at lr 1e-2), the summary the sampled and the greedy KL under
    their own names, and each problem's correctness before and after."""
    summary = train(tiny_cfg(tmp_path / "run", steps=2, eval_every=1, learning_rate=1e-2), progress=False)
    records = _metrics(tmp_path / "run")
    assert all(r["eval_kl_sampled_per_seq"] > 0 for r in records)
    assert summary["eval_kl_sampled_per_seq"] > 0 and summary["eval_kl_per_seq"] >= 0
    assert summary["eval_kl_sampled_per_seq"] != summary["eval_kl_per_seq"]
    assert len(summary["per_problem_after"]) == summary["eval_size"] == 4
    assert sum(summary["per_problem_after"]) / 4 == pytest.approx(summary["accuracy_after"])


def test_behaviour_kl_is_k3_of_the_sampler_against_the_learner(tmp_path):
    """One update a rollout: the learner's log-probs at the sampled tokens equal the sampler's up to
    float rounding, so the sampler-learner KL is ~0; shifting the sampler's log-probs of the answer
    tokens by d gives k3 = exp(-d) - 1 + d per token: d = 0.1 -> 0.0048374 (1e-5: the sampler's
    log-probs are float32, and k3 cancels two terms of 0.1 into one of 0.005)."""
    run = build_run(tiny_cfg(tmp_path / "run", dtype="float64"))
    record, _ = prepared(run)
    update = optimize(run, record, 0)
    assert behaviour_kl(update.terms) == pytest.approx(0.0, abs=1e-12)  # float32 rounding: k3 is quadratic
    mask = update.terms.mask
    update.terms.log_weights = torch.where(mask, update.terms.log_weights - 0.1, 0.0)
    assert behaviour_kl(update.terms) == pytest.approx(torch.tensor(-0.1).exp().item() - 1 + 0.1, rel=1e-5)
