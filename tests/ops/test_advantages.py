"""group_advantages and reward_to_go: SPEC values, labels in any order, degenerate groups."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.ops import ADVANTAGE_MODES, STD_MODES, group_advantages, reward_to_go

F64 = torch.float64


def _t(values):
    return torch.tensor(values, dtype=F64)


def _close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), rtol=0, atol=atol)


def _naive_group(rewards: list[float], mode: str, std: str, eps: float) -> list[float]:
    """Textbook per-group formulas, one group, plain Python."""
    n = len(rewards)
    mean = sum(rewards) / n
    if max(rewards) == min(rewards):
        return [0.0] * n
    if mode == "dr_grpo":
        return [r - mean for r in rewards]
    if mode == "rloo":
        return [r - (sum(rewards) - r) / (n - 1) for r in rewards]
    ddof = 1 if std == "unbiased" else 0
    spread = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(n - ddof, 1))
    return [(r - mean) / (spread + eps) for r in rewards]


def test_spec_alternating_rewards():
    """[1, 0, 1, 0]: mean 1/2, deviations +-1/2. Bessel std sqrt(1/3) -> +-sqrt(3)/2 =
    0.866025; population std 1/2 -> +-1; dr_grpo +-1/2; rloo: baseline of a 1 is 1/3, of a 0
    is 2/3 -> +-2/3."""
    r = _t([1.0, 0.0, 1.0, 0.0])
    sign = _t([1.0, -1.0, 1.0, -1.0])
    _close(group_advantages(r, eps=0.0), sign * math.sqrt(3) / 2)
    _close(group_advantages(r), sign * 0.866025, 5e-6)
    _close(group_advantages(r, std="population", eps=0.0), sign)
    _close(group_advantages(r, mode="dr_grpo"), sign * 0.5)
    _close(group_advantages(r, mode="rloo"), sign * 2 / 3)
    _close(group_advantages(r, mode="rloo"), sign * 0.666667, 5e-7)


def test_spec_three_to_one_rewards():
    """[1, 1, 1, 0]: mean 3/4, squared deviations 3/16 + 9/16 = 3/4, Bessel var 1/4, std 1/2
    -> [1/2, 1/2, 1/2, -3/2]; rloo: 1 - 2/3 = 1/3 and 0 - 1 = -1."""
    r = _t([1.0, 1.0, 1.0, 0.0])
    _close(group_advantages(r, eps=0.0), [0.5, 0.5, 0.5, -1.5])
    _close(group_advantages(r, mode="rloo"), [1 / 3, 1 / 3, 1 / 3, -1.0])


def test_rows_and_labels_agree_with_interleaved_negative_labels():
    """Two groups given as rows, and the same groups as labels -3 and 10 interleaved."""
    rows = _t([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    flat = _t([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    labels = torch.tensor([-3, 10, -3, 10, -3, 10, -3, 10])
    for mode in ADVANTAGE_MODES:
        by_rows = group_advantages(rows, mode=mode)
        by_labels = group_advantages(flat, labels, mode=mode)
        _close(by_labels[labels == -3], by_rows[0])
        _close(by_labels[labels == 10], by_rows[1])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-4, 4), st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0])), min_size=1, max_size=24),
    st.sampled_from(["grpo", "dr_grpo", "rloo"]),
    st.sampled_from(list(STD_MODES)),
)
def test_matches_per_group_reference(samples, mode, std):
    """Random labels (unsorted, unequal sizes) against the per-group textbook formulas."""
    labels = torch.tensor([g for g, _ in samples])
    rewards = _t([r for _, r in samples])
    counts = {g: sum(1 for h, _ in samples if h == g) for g, _ in samples}
    if mode == "rloo" and min(counts.values()) < 2:
        with pytest.raises(ValueError, match="rloo"):
            group_advantages(rewards, labels, mode=mode, std=std)
        return
    got = group_advantages(rewards, labels, mode=mode, std=std)
    for g in counts:
        idx = [i for i, (h, _) in enumerate(samples) if h == g]
        expected = _naive_group([samples[i][1] for i in idx], mode, std, 1e-6)
        _close(got[idx], expected, 1e-9)


@pytest.mark.parametrize("mode", list(ADVANTAGE_MODES))
def test_all_equal_groups_give_exact_zero(mode):
    """0.1 * 3 / 3 != 0.1 in float64, so a computed mean leaves a residue; the result must
    still be exactly 0 (and never NaN, also with eps = 0)."""
    rewards = _t([[0.1, 0.1, 0.1], [7.0, 7.0, 7.0], [0.0, 1.0, 0.0]])
    out = group_advantages(rewards, mode=mode, eps=0.0)
    assert torch.equal(out[:2], torch.zeros(2, 3, dtype=F64))
    assert torch.isfinite(out).all() and out[2].abs().sum() > 0


def test_singleton_groups():
    """grpo / dr_grpo: a lone sample has advantage 0. rloo: an error naming the group."""
    rewards, labels = _t([3.0, 1.0, 2.0]), torch.tensor([5, 9, 9])
    assert group_advantages(rewards, labels)[0].item() == 0.0
    assert group_advantages(rewards, labels, mode="dr_grpo")[0].item() == 0.0
    with pytest.raises(ValueError, match=r"group id\(s\) \[5\] have 1"):
        group_advantages(rewards, labels, mode="rloo")
    with pytest.raises(ValueError, match=r"row\(s\) \[0, 1\] have 1"):
        group_advantages(_t([[1.0], [2.0]]), mode="rloo")


def test_integer_rewards_and_single_group_default():
    out = group_advantages(torch.tensor([1, 0, 1, 0]), mode="dr_grpo")
    assert out.is_floating_point()
    torch.testing.assert_close(out, torch.tensor([0.5, -0.5, 0.5, -0.5]))


def test_advantage_errors():
    r = _t([1.0, 0.0])
    with pytest.raises(ValueError, match=r"mode: expected one of .*'grpo', 'dr_grpo', 'rloo'.*, got 'ppo'"):
        group_advantages(r, mode="ppo")
    with pytest.raises(ValueError, match=r"std: expected one of .*'unbiased', 'population'.*, got 'sample'"):
        group_advantages(r, std="sample")
    with pytest.raises(TypeError, match=r"group_ids must be an integer tensor"):
        group_advantages(r, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"group_ids must have the shape of rewards \(2,\); got \(3,\)"):
        group_advantages(r, torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match=r"group_ids must be None when rewards is 2-D"):
        group_advantages(r[None], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"rewards must be \[N\].*got shape \(1, 2, 1\)"):
        group_advantages(r[None, :, None])
    with pytest.raises(TypeError, match=r"rewards must be a torch.Tensor"):
        group_advantages([1.0, 0.0])


# ---------------------------------------------------------------- reward_to_go


def _naive_rtg(rewards, mask, gamma):
    out = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        valid = [t for t in range(rewards.shape[1]) if mask[b, t]]
        for i, t in enumerate(valid):
            out[b, t] = sum(gamma**k * rewards[b, s] for k, s in enumerate(valid[i:]))
    return out


def test_reward_to_go_hand_values():
    """Row [1, 2, (pad 100), 4], gamma 1/2, discount counted over valid tokens only:
    G_3 = 4, G_1 = 2 + 4/2 = 4, G_0 = 1 + 4/2 = 3; the masked slot gets 0.
    gamma = 1 gives [7, 6, 0, 4]."""
    rewards = _t([[1.0, 2.0, 100.0, 4.0]])
    mask = torch.tensor([[True, True, False, True]])
    _close(reward_to_go(rewards, mask, gamma=0.5), [[3.0, 4.0, 0.0, 4.0]])
    _close(reward_to_go(rewards, mask), [[7.0, 6.0, 0.0, 4.0]])
    _close(reward_to_go(rewards, mask, gamma=0.0), [[1.0, 2.0, 0.0, 4.0]])


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.lists(st.tuples(st.floats(-3, 3), st.booleans()), min_size=6, max_size=6), min_size=1, max_size=4),
    st.sampled_from([1.0, 0.9, 0.5, 0.0]),
)
def test_reward_to_go_matches_naive_and_ignores_padding(rows, gamma):
    rewards = _t([[r for r, _ in row] for row in rows])
    mask = torch.tensor([[m for _, m in row] for row in rows])
    got = reward_to_go(rewards, mask, gamma=gamma)
    _close(got, _naive_rtg(rewards, mask, gamma), 1e-12)
    pad = torch.full((len(rows), 3), float("nan"), dtype=F64)
    left = reward_to_go(torch.cat([pad, rewards, pad], 1), torch.cat([pad.isinf(), mask, pad.isinf()], 1), gamma=gamma)
    _close(left[:, 3:-3], got, 1e-12)
    assert torch.equal(left[:, :3], torch.zeros_like(pad))


def test_reward_to_go_gradient():
    """d(sum_t G_t)/d r_s = sum over valid t <= s of gamma^(steps from t to s): for a full
    row of 3 and gamma 1/2 that is [1, 1.5, 1.75]; masked rewards get 0."""
    rewards = torch.zeros(1, 4, dtype=F64, requires_grad=True)
    mask = torch.tensor([[True, True, False, True]])
    reward_to_go(rewards, mask, gamma=0.5).sum().backward()
    _close(rewards.grad, [[1.0, 1.5, 0.0, 1.75]])


def test_reward_to_go_errors():
    rewards, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"gamma: expected a finite number in \[0, 1\], got 1.5"):
        reward_to_go(rewards, mask, gamma=1.5)
    with pytest.raises(TypeError, match=r"mask must be a bool tensor"):
        reward_to_go(rewards, mask.long())
    with pytest.raises(ValueError, match=r"rewards must be \[B, T\].*got \(2, 3, 1\)"):
        reward_to_go(rewards[..., None], mask)
