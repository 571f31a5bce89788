"""KLComputation: hand-derived KL and reward values, layouts, scopes, gradients, errors.

The worked batch (B=2, T=4, left padding) used throughout:

    attention  row0 [F, T, T, T]          row1 [T, T, T, T]
    assistant  row0 [F, F, T, T]          row1 [F, T, T, F]
    gen        row0 [0, 0, -1.0, -0.5]    row1 [0, -2.0, 0.0, -1.0]
    ref        row0 [0, -3.0, -1.5, -0.25] row1 [0, -1.0, -0.5, -3.0]

k1 = gen - ref on the assistant mask: row0 [0, 0, 0.5, -0.25], row1 [0, -1.0, 0.5, 0].
Row 1 position 2 has a policy log-prob of exactly 0 inside the mask: it counts (0.5).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from tensordict import TensorDict

from tether.llm import KLComputation
from tether.ops import padded_to_nested

ATT = torch.tensor([[False, True, True, True], [True, True, True, True]])
ASST = torch.tensor([[False, False, True, True], [False, True, True, False]])
GEN = torch.tensor([[0.0, 0.0, -1.0, -0.5], [0.0, -2.0, 0.0, -1.0]], dtype=torch.float64)
REF = torch.tensor([[0.0, -3.0, -1.5, -0.25], [0.0, -1.0, -0.5, -3.0]], dtype=torch.float64)
K1 = torch.tensor([[0.0, 0.0, 0.5, -0.25], [0.0, -1.0, 0.5, 0.0]], dtype=torch.float64)


def batch(*, nested=False, assistant=True, reward=None, next_td=False):
    lay = (lambda x: padded_to_nested(x, ATT)) if nested else (lambda x: x)
    entries = {("log_probs", "full"): lay(GEN), ("ref_log_probs", "full"): lay(REF),
               ("masks", "all_attention_mask"): lay(ATT)}
    if assistant:
        entries["masks", "all_assistant_mask"] = lay(ASST)
    td = TensorDict(entries, batch_size=[2])
    if reward is not None:
        target = td
        if next_td:
            td["next"] = TensorDict(batch_size=[2])
            target = td["next"]
        target["reward"] = reward
    return td


def valid_rows(x, mask=ATT):
    return list(x.unbind()) if x.is_nested else [r[m] for r, m in zip(x, mask)]


def test_k1_on_the_assistant_mask():
    td = KLComputation(add_to_reward=False)(batch())
    torch.testing.assert_close(td["kl_penalty"], K1, rtol=0, atol=0)


def test_attention_mask_when_no_assistant_mask():
    """Without an assistant mask every attended token counts: row0 t1 adds 0-(-3)=3, row1
    t3 adds -1-(-3)=2; the padded row0 t0 stays 0."""
    td = KLComputation(add_to_reward=False)(batch(assistant=False))
    expected = torch.tensor([[0.0, 3.0, 0.5, -0.25], [0.0, -1.0, 0.5, 2.0]], dtype=torch.float64)
    torch.testing.assert_close(td["kl_penalty"], expected, rtol=0, atol=0)


def test_no_mask_at_all_counts_every_position():
    td = TensorDict({("log_probs", "full"): GEN, ("ref_log_probs", "full"): REF}, batch_size=[2])
    td = KLComputation(add_to_reward=False)(td)
    torch.testing.assert_close(td["kl_penalty"], GEN - REF, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(2, 1), (2, 1, 1)])
def test_sequence_reward_is_broadcast_per_token(shape):
    """reward [[1], [2]] (or [[[1]], [[2]]], the seed tests' [B, 1, 1]), coeff 0.5: r - 0.5*k1
    on attended tokens, 0 on padding: row0 [0, 1, 0.75, 1.125], row1 [2, 2.5, 1.75, 2]."""
    reward = torch.tensor([1.0, 2.0], dtype=torch.float64).reshape(shape)
    td = KLComputation(coeff=0.5)(batch(reward=reward))
    expected = torch.tensor([[0.0, 1.0, 0.75, 1.125], [2.0, 2.5, 1.75, 2.0]], dtype=torch.float64)
    assert td["reward"].shape == (2, 4, 1)
    torch.testing.assert_close(td["reward"].squeeze(-1), expected, rtol=0, atol=0)


def test_token_reward():
    """Per-token reward row0 [0,0,0,1], row1 [0,0,0,2], coeff 0.5:
    row0 [0, 0, -0.25, 1.125], row1 [0, 0.5, -0.25, 2]."""
    reward = torch.tensor([[0.0, 0, 0, 1], [0, 0, 0, 2]], dtype=torch.float64)[..., None]
    td = KLComputation(coeff=0.5)(batch(reward=reward))
    expected = torch.tensor([[0.0, 0.0, -0.25, 1.125], [0.0, 0.5, -0.25, 2.0]], dtype=torch.float64)
    torch.testing.assert_close(td["reward"].squeeze(-1), expected, rtol=0, atol=0)


@pytest.mark.parametrize("per_token", [False, True])
def test_nested_layout_equals_padded(per_token):
    reward = torch.tensor([[1.0], [2.0]], dtype=torch.float64)
    if per_token:
        reward = torch.tensor([[0.0, 0, 0, 1], [0, 0, 0, 2]], dtype=torch.float64)[..., None]
    padded = KLComputation(coeff=0.5)(batch(reward=reward))
    nested_reward = padded_to_nested(reward, ATT) if per_token else reward
    nested = KLComputation(coeff=0.5)(batch(nested=True, reward=nested_reward))
    assert nested["kl_penalty"].is_nested and nested["reward"].is_nested
    for a, b in zip(valid_rows(nested["kl_penalty"]), valid_rows(padded["kl_penalty"])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(valid_rows(nested["reward"]), valid_rows(padded["reward"])):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    "estimator, value",
    [("k2", 0.125), ("k3", math.exp(-0.5) - 0.5), ("abs", 0.5)],
)
def test_estimators(estimator, value):
    """Row 0 position 2 has r = 0.5: k2 = r^2/2, k3 = exp(-r) - 1 + r, abs = |r|."""
    td = KLComputation(add_to_reward=False, estimator=estimator)(batch())
    assert td["kl_penalty"][0, 2].item() == pytest.approx(value, abs=1e-15)
    assert td["kl_penalty"][0, 0] == 0 and td["kl_penalty"][1, 3] == 0


def test_reads_next_then_root_and_writes_into_next():
    """Reference log-probs in "next", policy log-probs and masks at the root (as after
    sampling): the KL and reward land in "next"."""
    td = batch(reward=torch.tensor([[1.0], [2.0]], dtype=torch.float64), next_td=True)
    td["next", "ref_log_probs", "full"] = td.pop(("ref_log_probs", "full"))
    td = KLComputation()(td)
    torch.testing.assert_close(td["next", "kl_penalty"], K1, rtol=0, atol=0)
    assert "kl_penalty" not in td.exclude("next").keys()


def test_gradient_reaches_the_policy_log_probs_on_the_mask_only():
    gen = GEN.clone().requires_grad_(True)
    td = batch()
    td["log_probs", "full"] = gen
    KLComputation(add_to_reward=False)(td)["kl_penalty"].sum().backward()
    torch.testing.assert_close(gen.grad, ASST.double(), rtol=0, atol=0)


def test_kl_coef_is_read_write_and_used():
    module = KLComputation(coeff=0.5)
    module.kl_coef = 2.0
    assert module.coeff == 2.0
    td = module(batch(reward=torch.tensor([[1.0], [2.0]], dtype=torch.float64)))
    assert td["reward"][1, 1, 0].item() == pytest.approx(2.0 + 2.0 * 1.0)
    with pytest.raises(ValueError, match="kl_coef.*>= 0"):
        module.kl_coef = -0.1
    with pytest.raises(TypeError, match="kl_coef"):
        module.kl_coef = "high"


def test_missing_log_probs_name_the_keys_and_list_present_ones():
    td = TensorDict({("log_probs", "full"): GEN}, batch_size=[2])
    with pytest.raises(KeyError) as err:
        KLComputation(add_to_reward=False)(td)
    message = err.value.args[0]
    assert message.startswith("[('ref_log_probs', 'full')]: expected")
    assert "Present keys: [('log_probs', 'full')]" in message


def test_missing_reward_says_how_to_fix():
    with pytest.raises(KeyError, match="reward.*add_to_reward=False"):
        KLComputation()(batch())
    td = KLComputation(add_to_reward=False)(batch())
    assert "reward" not in td.keys()


def test_shape_mismatch_between_gen_and_ref():
    td = batch(assistant=False)
    td["ref_log_probs", "full"] = REF[:, 1:]
    with pytest.raises(ValueError, match=r"shapes \(2, 4\) and \(2, 3\)"):
        KLComputation(add_to_reward=False)(td.exclude(("masks", "all_attention_mask")))


def test_nested_row_length_mismatch_and_layout_mismatch():
    td = batch(nested=True)
    short = torch.nested.nested_tensor([torch.zeros(3), torch.zeros(3)], layout=torch.jagged)
    td["ref_log_probs", "full"] = short.double()
    with pytest.raises(ValueError, match=r"row lengths \[3, 4\] and \[3, 3\]"):
        KLComputation(add_to_reward=False)(td)
    td = batch(nested=True)
    td["ref_log_probs", "full"] = torch.nested.nested_tensor([torch.zeros(3), torch.zeros(4)], layout=torch.jagged)
    td["log_probs", "full"] = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="padded.*nested|nested.*padded"):
        KLComputation(add_to_reward=False)(td.exclude(("masks",)))


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("key", [("log_probs", "full"), ("ref_log_probs", "full")])
def test_nan_log_probs_inside_the_mask_are_refused_by_key(key, nested):
    """Row 1 position 1 is on the assistant mask: a NaN there is refused, naming the key and the
    position. Row 0 position 1 is attended but outside the assistant mask: a NaN there is ignored
    and every written value equals the hand-derived one (row0 reward -> 1 - k1)."""
    values = (GEN if key[0] == "log_probs" else REF).clone()
    values[1, 1] = math.nan
    td = batch(nested=nested, reward=torch.ones(2, 1, dtype=torch.float64))
    td[key] = padded_to_nested(values, ATT) if nested else values
    expected = re.escape(repr(key)) + r": expected log-probs that are not NaN inside the KL mask, got 1 NaN \(the first"
    with pytest.raises(ValueError, match=expected + r" at row 1, position 1\)"):
        KLComputation()(td)
    values = (GEN if key[0] == "log_probs" else REF).clone()
    values[0, 1] = math.nan
    td = batch(reward=torch.ones(2, 1, dtype=torch.float64))
    td[key] = values
    out = KLComputation()(td)
    torch.testing.assert_close(out["kl_penalty"], K1, rtol=0, atol=0)
    torch.testing.assert_close(out["reward"][..., 0], torch.where(ATT, 1.0 - K1, 0.0), rtol=0, atol=0)


def test_bad_reward_and_mask_shapes():
    with pytest.raises(ValueError, match=r"reward.*\[2, 4\]"):
        KLComputation()(batch(reward=torch.ones(2, 4)))
    with pytest.raises(ValueError, match=r"\[2, 4, 1\] per token .* got \[2, 3, 1\]\. Give one reward per sequence") as err:
        KLComputation()(batch(reward=torch.ones(2, 3, 1)))
    assert "trailing singleton" not in str(err.value)
    td = batch()
    td["masks", "all_assistant_mask"] = ASST[:, :3]
    with pytest.raises(ValueError, match="all_assistant_mask.*shape"):
        KLComputation(add_to_reward=False)(td)


def test_constructor_errors():
    with pytest.raises(ValueError, match="estimator.*k1"):
        KLComputation(estimator="k4")
    with pytest.raises(ValueError, match="two different entries"):
        KLComputation(("a", "full"), ("a", "full"))
    with pytest.raises(ValueError, match="padding_side"):
        KLComputation(padding_side="up")
    with pytest.raises(TypeError, match="kl_key"):
        KLComputation(kl_key=1.5)
