"""GRPOLoss options, keys and error paths: typed errors that name the argument or key."""

from __future__ import annotations

import math

import pytest
import torch

from tether.objectives import GRPOKeys, GRPOLoss
from tests.objectives.helpers import F64, UnigramActor, make_batch, place


@pytest.fixture
def actor():
    return UnigramActor([1.0, 0.0, -1.0])


def batch(actor, **kwargs):
    tokens = torch.tensor([[0, 1, 2, 1], [2, 2, 0, 0]])
    attention = torch.tensor([[True, True, True, True], [True, True, True, False]])
    loss_mask = torch.tensor([[False, False, True, True], [False, True, True, False]])
    rho = place([[0.2, -0.1], [0.3, 0.05]], loss_mask)
    return make_batch(actor, tokens, attention, loss_mask, torch.tensor([1.0, -1.0]), rho=rho, **kwargs)


def test_missing_key_names_it_and_lists_present_keys(actor):
    td = batch(actor)
    del td["advantage"]
    with pytest.raises(KeyError, match=r"advantage.*missing.*Present keys: .*log_probs"):
        GRPOLoss(actor)(td)
    td = batch(actor)
    del td["ref_log_probs"]
    with pytest.raises(KeyError, match=r"ref_log_probs.*under .*next.*missing"):
        GRPOLoss(actor, kl_to_ref_coeff=0.1)(td)
    # Without the KL term the reference log-probs are not needed.
    GRPOLoss(actor)(td)


def test_reference_log_probs_are_found_under_next(actor):
    """tether.llm writes ('next', 'ref_log_probs', 'full') when the batch has a 'next' entry;
    the value is the same as at the root."""
    td = batch(actor)
    at_root = GRPOLoss(actor, kl_to_ref_coeff=0.1)(td).kl_to_ref
    td["next", "ref_log_probs", "full"] = td["ref_log_probs", "full"]
    del td["ref_log_probs"]
    torch.testing.assert_close(GRPOLoss(actor, kl_to_ref_coeff=0.1)(td).kl_to_ref, at_root, rtol=0, atol=0)


def test_set_keys_redirects_and_rejects_unknown_names(actor):
    td = batch(actor)
    td.rename_key_("advantage", "adv")
    loss = GRPOLoss(actor).set_keys(advantage="adv")
    assert loss.tensor_keys.advantage == "adv" and isinstance(loss.tensor_keys, GRPOKeys)
    loss(td)
    with pytest.raises(ValueError, match=r"unknown entries \['advantages'\].*advantage"):
        loss.set_keys(advantages="x")


def test_bad_batches(actor):
    td = batch(actor)
    td.batch_size = torch.Size([])
    td["advantage"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"'advantage'.*\[B\], \[B, 1\].*B = 2; got shape \(3,\)"):
        GRPOLoss(actor)(td)
    td["advantage"] = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"'advantage'.*per-token tensor \[B, T\] = \(2, 4\)"):
        GRPOLoss(actor)(td)
    td = batch(actor)
    td["log_probs", "full"] = td["log_probs", "full"].clone().requires_grad_()
    with pytest.raises(ValueError, match=r"require grad.*detach"):
        GRPOLoss(actor)(td)
    td = batch(actor)
    td["log_probs", "full"][0, 2] = float("nan")
    with pytest.raises(ValueError, match=r"1 value\(s\) inside the loss mask are not finite"):
        GRPOLoss(actor)(td)
    td = batch(actor)
    td["masks", "all_assistant_mask"][1, 0] = True
    with pytest.raises(ValueError, match=r"first token of a row"):
        GRPOLoss(actor)(td)
    td = batch(actor)
    td["log_probs", "full"] = td["log_probs", "full"][:, :3]
    with pytest.raises(ValueError, match=r"'log_probs', 'full'.*\[B, T\] = \(2, 4\)"):
        GRPOLoss(actor)(td)


def test_mixed_layouts_are_refused(actor):
    td = batch(actor)
    attention = td["masks", "all_attention_mask"]
    td["tokens", "full"] = torch.nested.nested_tensor(
        [row[m] for row, m in zip(td["tokens", "full"], attention)], layout=torch.jagged
    )
    with pytest.raises(ValueError, match=r"tokens are jagged.*padded"):
        GRPOLoss(actor)(td)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        ({"kl_estimator": "k1", "kl_to_ref_coeff": 0.1}, ValueError, r"kl_estimator='k1'.*expected gradient"),
        ({"aggregation": "mean"}, ValueError, r"aggregation: expected one of .*token-mean.*, got 'mean'"),
        ({"aggregation": "seq-mean-token-sum-norm"}, ValueError, r"aggregation='seq-mean-token-sum-norm' needs normalizer"),
        ({"normalizer": 4.0}, ValueError, r"normalizer is only used"),
        ({"clip_epsilon": 1.5}, ValueError, r"clip_epsilon low"),
        ({"clip_epsilon": "0.2"}, TypeError, r"clip_epsilon"),
        ({"dual_clip": 0.5}, ValueError, r"dual_clip: expected a finite number > 1"),
        ({"ratio_level": "seq"}, ValueError, r"ratio_level: expected one of .*'sequence'.*, got 'seq'"),
        ({"importance_correction": "is"}, ValueError, r"importance_correction: expected one of .*'tis'.*, got 'is'"),
        ({"importance_correction": "tis", "importance_cap": 0.0}, ValueError, r"importance_cap: expected a finite number > 0"),
        ({"kl_to_ref_coeff": -1.0}, ValueError, r"kl_to_ref_coeff: expected a finite number >= 0, got -1.0"),
        ({"kl_to_inference_coeff": math.nan}, ValueError, r"kl_to_inference_coeff: expected a finite number >= 0, got nan"),
        ({"kl_correction": "weights"}, ValueError, r"kl_correction: expected one of .*, got 'weights'"),
        ({"samples_mc_entropy": 0}, ValueError, r"samples_mc_entropy"),
        ({"entropy_bonus": 1}, TypeError, r"entropy_bonus"),
    ],
)
def test_bad_options_fail_at_construction(actor, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        GRPOLoss(actor, **kwargs)


def test_actor_without_score_is_refused():
    with pytest.raises(TypeError, match=r"actor_network must have a score"):
        GRPOLoss(torch.nn.Linear(2, 2))


class _NoEntropyActor(UnigramActor):
    def score(self, tokens, attention_mask, *, with_entropy=False):
        stats = super().score(tokens, attention_mask)
        return type(stats)(log_probs=stats.log_probs, entropy=None)


def test_actor_without_entropy_needs_the_bonus_off():
    actor = _NoEntropyActor([1.0, 0.0, -1.0])
    with pytest.raises(TypeError, match=r"returned no entropy.*entropy_bonus=False"):
        GRPOLoss(actor)(batch(actor))
    assert GRPOLoss(actor, entropy_bonus=False)(batch(actor)).entropy is None


def test_kl_coef_aliases_kl_to_ref_coeff(actor):
    """A controller drives kl_coef: reading and writing it is reading and writing
    kl_to_ref_coeff, and the KL loss term scales with it."""
    td = batch(actor)
    loss = GRPOLoss(actor, kl_to_ref_coeff=0.1)
    first = loss(td).loss_kl_to_ref
    loss.kl_coef = 0.3
    assert loss.kl_to_ref_coeff == 0.3 and loss.kl_coef == 0.3
    torch.testing.assert_close(loss(td).loss_kl_to_ref, 3 * first, rtol=1e-14, atol=0)
    loss.kl_coef = None
    assert loss(td).loss_kl_to_ref is None
    with pytest.raises(ValueError, match="kl_to_ref_coeff"):
        loss.kl_coef = -0.5


def test_torchrl_aggregation_names_are_accepted(actor):
    td = batch(actor)
    for alias, name in (("token_mean", "token-mean"), ("prompt_mean", "seq-mean-token-mean")):
        a, b = GRPOLoss(actor, aggregation=alias)(td), GRPOLoss(actor, aggregation=name)(td)
        torch.testing.assert_close(a.loss_objective, b.loss_objective, rtol=0, atol=0)


def test_in_and_out_keys(actor):
    loss = GRPOLoss(actor, kl_to_ref_coeff=0.1)
    assert ("ref_log_probs", "full") in loss.in_keys and "advantage" in loss.in_keys
    assert loss.out_keys[:4] == ["loss_objective", "clip_fraction", "kl_approx", "ESS"]
    assert set(GRPOLoss(actor).in_keys) == set(loss.in_keys) - {("ref_log_probs", "full")}
    assert batch(actor)["advantage"].dtype == F64


def test_token_terms_reduce_to_forward_and_refuse_mismatched_parts(actor):
    """``forward == reduce(token_terms)``; terms of the two rows concatenated reduce to the same
    diagnostics; ``cat`` refuses an empty list and parts with different terms present; reduce
    refuses KL terms whose coefficient was switched off since they were computed."""
    from tether.objectives import GRPOTokenTerms

    td = batch(actor)
    loss = GRPOLoss(actor, kl_to_ref_coeff=0.1)
    out = loss(td)
    rows = GRPOTokenTerms.cat([loss.token_terms(td[i : i + 1]).detach() for i in range(2)])
    again = loss.reduce(rows)
    for name in ("loss_objective", "clip_fraction", "kl_approx", "ESS", "entropy", "loss_kl_to_ref", "kl_to_ref"):
        torch.testing.assert_close(getattr(again, name), getattr(out, name).detach(), rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="at least one"):
        GRPOTokenTerms.cat([])
    plain = GRPOLoss(actor).token_terms(td)
    with pytest.raises(ValueError, match="kl_to_ref_term.*some micro-batches"):
        GRPOTokenTerms.cat([plain, loss.token_terms(td)])
    terms = loss.token_terms(td)
    loss.kl_coef = None
    with pytest.raises(ValueError, match="kl_to_ref_coeff is None"):
        loss.reduce(terms)
