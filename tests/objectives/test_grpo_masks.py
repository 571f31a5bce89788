"""Masks and layouts: padding, longer prompts and layouts never change GRPOLoss values.

Also one test per seed defect of SPEC section 8: padding found by ``log_prob != 0``, KL
averaged over the padded grid, KL ignoring the aggregation mode, private keys left in the
caller's TensorDict.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from tether.objectives import GRPOLoss
from tether.ops.masks import repack
from tether.ops import padded_to_nested
from tests.objectives.helpers import F64, UnigramActor, make_batch, place, scored, tiny_wrapper, two_row_grid

DELTA = [[math.log(1.5), math.log(0.9)], [math.log(0.5), math.log(1.1), 0.0]]
RHO = [[0.5, -0.2], [0.1, 0.3, -0.4]]
FIELDS = ("loss_objective", "clip_fraction", "kl_approx", "ESS", "entropy", "loss_entropy",
          "loss_kl_to_ref", "kl_to_ref", "loss_kl_to_inference", "kl_to_inference")


@pytest.fixture(scope="module")
def actor():
    return tiny_wrapper()


def full_loss(actor, **kwargs):
    return GRPOLoss(actor, kl_to_ref_coeff=0.1, kl_to_inference_coeff=0.05, **kwargs)


def base_batch(actor, outside=float("nan")):
    tokens, attention, loss_mask = two_row_grid()
    return make_batch(actor, tokens, attention, loss_mask, torch.tensor([1.0, -2.0]),
                      delta=place(DELTA, loss_mask), rho=place(RHO, loss_mask), outside=outside)


def pad_columns(td, extra, side, pad_id=259):
    """The same batch with ``extra`` padding columns on ``side`` (NaN log-probs there)."""
    def widen(value, fill):
        block = torch.full((value.shape[0], extra), fill, dtype=value.dtype)
        return torch.cat([value, block] if side == "right" else [block, value], dim=1)

    out = TensorDict(batch_size=td.batch_size)
    out["tokens", "full"] = widen(td["tokens", "full"], pad_id)
    for key in (("masks", "all_attention_mask"), ("masks", "all_assistant_mask")):
        out[key] = widen(td[key], False)
    for key in (("log_probs", "full"), ("ref_log_probs", "full")):
        out[key] = widen(td[key], float("nan"))
    out["advantage"] = td["advantage"]
    return out


def outputs_and_grad(loss, td):
    loss.zero_grad()
    out = loss(td)
    out.total_loss().backward()
    grads = torch.cat([p.grad.flatten() for p in loss.parameters() if p.grad is not None])
    return {name: getattr(out, name).detach() for name in FIELDS}, grads


def assert_same(a, b, atol=1e-11):
    for name in FIELDS:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_to_twice_the_length_changes_nothing(actor, side):
    """Six extra padding columns (NaN log-probs there) on either side: every loss term,
    every diagnostic and the parameter gradient are unchanged."""
    loss = full_loss(actor, aggregation="seq-mean-token-mean")
    td = base_batch(actor)
    ref, ref_grad = outputs_and_grad(loss, td)
    got, got_grad = outputs_and_grad(loss, pad_columns(td, td["tokens", "full"].shape[1], side))
    assert_same(ref, got)
    torch.testing.assert_close(got_grad, ref_grad, rtol=1e-10, atol=1e-12)


def unigram_batch(actor, prompt_extra):
    """Two rows: prompt of 2 (+ prompt_extra) tokens, responses of 2 and 3 tokens, right-padded."""
    gen = torch.Generator().manual_seed(5)
    width = 2 + prompt_extra + 3
    tokens = torch.randint(0, 3, (2, width), generator=gen)
    attention = torch.ones(2, width, dtype=torch.bool)
    attention[0, -1] = False
    loss_mask = torch.zeros(2, width, dtype=torch.bool)
    start = 2 + prompt_extra
    loss_mask[0, start:start + 2] = True
    loss_mask[1, start:] = True
    fixed = torch.tensor([[1, 2, 0, 9], [2, 0, 1, 1]])  # response tokens are the same in both batches
    tokens[0, start:start + 2] = fixed[0, :2]
    tokens[1, start:] = fixed[1, :3]
    return make_batch(actor, tokens, attention, loss_mask, torch.tensor([1.0, -2.0]),
                      delta=place(DELTA, loss_mask), rho=place(RHO, loss_mask))


def test_longer_prompts_change_nothing():
    """A context-free policy scores each response token the same whatever the prompt, so
    prepending 20 prompt tokens (outside the loss mask) must leave every value unchanged.
    The seed's grid mean would shrink the reported KL by the valid fraction (5 / 14 -> 5 / 54)."""
    actor = UnigramActor([1.0, 0.0, -1.0])
    loss = full_loss(actor)
    short, short_grad = outputs_and_grad(loss, unigram_batch(actor, 0))
    long, long_grad = outputs_and_grad(loss, unigram_batch(actor, 20))
    assert_same(short, long, atol=1e-13)
    torch.testing.assert_close(long_grad, short_grad, rtol=0, atol=1e-13)


@pytest.mark.parametrize("extra", [0, 6, 18])
def test_reported_kl_is_the_masked_mean_whatever_the_padding(actor, extra):
    """kl_to_ref is the mean of k3 = exp(-rho) - 1 + rho over the 5 response tokens, with 0,
    6 or 18 padding columns (5/12 down to 5/48 of the grid valid). Seed defect: the mean over
    the padded grid would report that fraction of the KL."""
    td = pad_columns(base_batch(actor), extra, "right") if extra else base_batch(actor)
    expected = sum(math.exp(-r) - 1 + r for row in RHO for r in row) / 5
    out = full_loss(actor)(td)
    torch.testing.assert_close(out.kl_to_ref, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)


def test_token_with_log_prob_exactly_zero_is_counted():
    """Seed defect: padding found by log_prob != 0. A context-free policy with logits
    [40, 0, 0] gives token 0 the log-prob 0.0 exactly (40 + log(1 + 2 e^-40) rounds to 40).
    Row: prompt token 1, response [0, 0], sampled on-policy (log-prob 0 as well), reference
    log-probs [log 0.5, log 0.25]. The seed would see no valid token at all. Here both
    count: k3 = exp(u) - 1 - u with u = ref - cur gives kl_to_ref = mean over the two,
    the surrogate is -A = -1 (ratio 1), and ESS over two equal weights is 1."""
    actor = UnigramActor([40.0, 0.0, 0.0])
    tokens = torch.tensor([[1, 0, 0]])
    attention = torch.ones(1, 3, dtype=torch.bool)
    loss_mask = torch.tensor([[False, True, True]])
    cur = scored(actor, tokens, attention).log_probs
    assert cur[0, 1:].tolist() == [0.0, 0.0]
    td = make_batch(actor, tokens, attention, loss_mask, torch.tensor([1.0]))
    assert td["log_probs", "full"][0, 1:].tolist() == [0.0, 0.0]
    td["ref_log_probs", "full"] = torch.tensor([[0.0, math.log(0.5), math.log(0.25)]], dtype=F64)
    out = GRPOLoss(actor, kl_to_ref_coeff=1.0)(td)
    expected = sum(math.exp(u) - 1 - u for u in (math.log(0.5), math.log(0.25))) / 2
    torch.testing.assert_close(out.kl_to_ref, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-13)
    torch.testing.assert_close(out.ESS, torch.tensor(1.0, dtype=F64), rtol=0, atol=1e-13)
    torch.testing.assert_close(out.loss_objective, torch.tensor(-1.0, dtype=F64), rtol=0, atol=1e-13)


def test_kl_loss_follows_the_aggregation_mode(actor):
    """Seed defect: KL ignoring the aggregation mode. With importance-weighted k3, per-token
    term w * k3 = exp(delta) (exp(-rho) - 1 + rho); seq-mean-token-mean averages each row's
    mean (2 and 3 tokens), token-mean all 5 tokens: the two differ and each matches."""
    terms = [[math.exp(d) * (math.exp(-r) - 1 + r) for d, r in zip(dr, rr)] for dr, rr in zip(DELTA, RHO)]
    token_mean = sum(sum(row) for row in terms) / 5
    seq_mean = (sum(terms[0]) / 2 + sum(terms[1]) / 3) / 2
    for mode, expected in (("token-mean", token_mean), ("seq-mean-token-mean", seq_mean)):
        out = GRPOLoss(actor, kl_to_ref_coeff=0.5, aggregation=mode)(base_batch(actor))
        torch.testing.assert_close(out.loss_kl_to_ref, torch.tensor(0.5 * expected, dtype=F64), rtol=0, atol=1e-12)
    assert abs(token_mean - seq_mean) > 1e-3


def test_callers_tensordict_is_left_unchanged(actor):
    """Seed defect: the seed wrote '_cur_log_prob' into the caller's TensorDict. Keys and
    values are the same after forward and backward."""
    td = base_batch(actor, outside=0.0)
    before = td.clone()
    keys_before = set(td.keys(include_nested=True, leaves_only=True))
    full_loss(actor)(td).total_loss().backward()
    assert set(td.keys(include_nested=True, leaves_only=True)) == keys_before
    assert (td == before).all()


def layouts(td):
    """The batch right-padded, left-padded, jagged, and as a lazy stack of unpadded rows."""
    attention = td["masks", "all_attention_mask"]
    per_token = [("tokens", "full"), ("masks", "all_assistant_mask"), ("log_probs", "full"), ("ref_log_probs", "full")]
    out = {}
    for side in ("left", "right"):
        moved = TensorDict({"advantage": td["advantage"]}, batch_size=td.batch_size)
        for key in per_token:
            moved[key], moved["masks", "all_attention_mask"] = repack(td[key], attention, side)
        out[side] = moved
    jagged = TensorDict({"advantage": td["advantage"]}, batch_size=td.batch_size)
    for key in per_token:
        jagged[key] = padded_to_nested(td[key], attention)
    out["jagged"] = jagged
    rows = []
    for row in range(td.shape[0]):
        valid = attention[row]
        rows.append(TensorDict({key: td[key][row][valid] for key in per_token}, batch_size=[]))
        rows[-1]["advantage"] = td["advantage"][row]
    out["lazy stack"] = lazy_stack(rows)
    return out


def test_padded_left_right_and_jagged_layouts_agree(actor):
    """Same rows stored right-padded, left-padded, as jagged nested tensors or as a lazy stack
    of unpadded rows (TorchRL collectors' layout): same values."""
    td = base_batch(actor, outside=0.0)
    loss = full_loss(actor, aggregation="seq-mean-token-sum")
    reference = {name: getattr(loss(td), name).detach() for name in FIELDS}
    for name, variant in layouts(td).items():
        got = {field: getattr(loss(variant), field).detach() for field in FIELDS}
        assert_same(reference, got, atol=1e-11)
