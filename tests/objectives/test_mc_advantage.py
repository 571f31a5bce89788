"""MCAdvantage and mc_group_advantages: grouping by prompt, splitting, modes, reward-to-go, errors."""

from __future__ import annotations

import math

import pytest
import tensordict
import torch
from tensordict import TensorDict

from tether.models.batch_io import write_objects
from tether.objectives import MCAdvantage, mc_group_advantages, prompt_group_key

F64 = torch.float64
EPS = 1e-6  # added to the group spread by grpo
JAGGED_SLICING = tuple(int(p) for p in tensordict.__version__.split(".")[:2]) >= (0, 15)


def z(centred, spread):
    return centred / (spread + EPS)


S3 = z(0.5, math.sqrt(1 / 3))  # [1, 0, 1, 0]: centred +-0.5, Bessel std sqrt(1/3): 0.866025


def steps(prompts, rewards, done=None):
    """One step per entry: prompt string, scalar reward [1] under ('next', 'reward')."""
    n = len(prompts)
    td = TensorDict(
        {
            ("next", "reward"): torch.tensor(rewards, dtype=F64).reshape(n, 1),
            ("next", "done"): torch.ones(n, 1, dtype=torch.bool) if done is None else torch.tensor(done).reshape(n, 1),
            "step": torch.arange(n),
        },
        batch_size=[n],
    )
    write_objects(td, "text", prompts)
    return td


def close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


@pytest.mark.parametrize(
    "mode, std, rewards, expected",
    [
        ("grpo", "unbiased", [1, 0, 1, 0], [S3, -S3, S3, -S3]),
        ("grpo", "population", [1, 0, 1, 0], [z(c, 0.5) for c in (0.5, -0.5, 0.5, -0.5)]),
        ("dr_grpo", "unbiased", [1, 0, 1, 0], [0.5, -0.5, 0.5, -0.5]),
        ("rloo", "unbiased", [1, 0, 1, 0], [2 / 3, -2 / 3, 2 / 3, -2 / 3]),
        ("grpo", "unbiased", [1, 1, 1, 0], [z(c, 0.5) for c in (0.25, 0.25, 0.25, -0.75)]),
        ("rloo", "unbiased", [1, 1, 1, 0], [1 / 3, 1 / 3, 1 / 3, -1]),
        ("grpo", "unbiased", [2, 2, 2, 2], [0, 0, 0, 0]),
    ],
)
def test_worked_values_through_add(mode, std, rewards, expected):
    """SPEC section 3: [1, 0, 1, 0] -> grpo +-0.866025 (Bessel) / +-1 (population), dr_grpo
    +-0.5, rloo +-2/3 (1 - mean of the other three = 1 - 1/3); [1, 1, 1, 0] -> Bessel
    [0.5, 0.5, 0.5, -1.5], rloo [1/3, 1/3, 1/3, -1]; an all-equal group -> 0. grpo values
    carry the eps = 1e-6 added to the spread (centred / (std + eps))."""
    out = MCAdvantage(4, mode=mode, std=std).add(steps(["p"] * 4, rewards))
    close(out["advantage"], torch.tensor(expected, dtype=F64).reshape(4, 1))
    assert out["advantage"].shape == out["next", "reward"].shape


def test_interleaved_prompts_are_grouped_and_queues_emptied():
    """Eight single-step trajectories, prompts a/b interleaved, group size 4: both groups come
    out, each normalised on its own rewards (a: [1, 0, 1, 0], b: [3, 1, 1, 1]). A group is
    emitted once: after it, the queue of its prompt is empty (the seed kept a sliding window
    and re-emitted old trajectories), so 3 more 'a' give nothing and the 4th gives exactly
    those four."""
    mc = MCAdvantage(4)
    td = steps(["a", "b", "a", "b", "a", "b", "a", "b"], [1, 3, 0, 1, 1, 1, 0, 1])
    out = mc.add(td)
    assert out.shape == (8,)
    assert out["text"] == ["a"] * 4 + ["b"] * 4
    assert out["step"].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    close(out["advantage"][:4, 0], [S3, -S3, S3, -S3])
    close(out["advantage"][4:, 0], [z(c, 1.0) for c in (1.5, -0.5, -0.5, -0.5)])  # b: Bessel std 1
    assert "advantage" not in td.keys()
    assert mc.pending() == {}
    assert mc.add(steps(["a"] * 3, [1, 1, 0])) is None
    assert mc.pending() == {prompt_group_key("a"): 3}
    out = mc.add(steps(["a"], [0]))
    assert out.shape == (4,)
    close(out["advantage"][:, 0], [S3, S3, -S3, -S3])


def test_batch_with_several_multi_step_trajectories_is_split_at_done():
    """A 1-D batch of 6 steps with done at steps 1, 4, 5 holds trajectories of 2, 3 and 1
    steps. Group size 3, one prompt: each step's reward [1, 0 | 0, 0, 2 | 1] is normalised
    against all six entries (the seed's rule): mean 2/3, Bessel std sqrt(4/5 * ... )."""
    rewards = [1.0, 0.0, 0.0, 0.0, 2.0, 1.0]
    td = steps(["q"] * 6, rewards, done=[False, True, False, False, True, True])
    out = MCAdvantage(3).add(td)
    r = torch.tensor(rewards, dtype=F64)
    close(out["advantage"][:, 0], (r - r.mean()) / (r.std() + 1e-6), atol=1e-12)
    assert out["step"].tolist() == list(range(6))


def test_two_dim_batch_rows_are_step_sequences():
    """[2, 3]: each row is a sequence of steps (here one 3-step trajectory per row); the seed
    unbound the time dim instead. Row rewards [1, 0, 0] and [0, 0, 3] with group size 2."""
    rows = [steps(["z"] * 3, [1, 0, 0], done=[False, False, True]), steps(["z"] * 3, [0, 0, 3], done=[False, False, True])]
    td = torch.stack(rows, 0)
    out = MCAdvantage(2, mode="dr_grpo").add(td)
    r = torch.tensor([1, 0, 0, 0, 0, 3], dtype=F64)
    close(out["advantage"][:, 0], r - r.mean(), atol=1e-12)


def test_unfinished_trajectory_is_refused():
    td = steps(["a", "a", "a"], [1, 0, 1], done=[True, False, False])
    with pytest.raises(ValueError, match=r"last 2 step\(s\) of a batch of 3 are not followed by a done"):
        MCAdvantage(2).add(td)


def test_prompts_must_be_strings_or_chats():
    td = steps(["a"], [1])
    td["prompt_ids"] = torch.tensor([[3, 4]])
    with pytest.raises(TypeError, match=r"prompt: expected a string or a chat.*Tensor"):
        MCAdvantage(2, prompt_key="prompt_ids").add(td)
    td = steps(["a"], [1])
    td["text", "prompt"] = td.pop("text")
    with pytest.raises(TypeError, match=r"sub-TensorDict.*\('text', 'prompt'\)"):
        MCAdvantage(2).add(td)


def test_chat_prompts_are_grouped_by_content():
    """Chats group by their canonical JSON: the same messages with keys in another order are
    the same prompt, a different message is another prompt."""
    chat_a = [{"role": "user", "content": "2+2?"}]
    chat_a_reordered = [{"content": "2+2?", "role": "user"}]
    chat_b = [{"role": "user", "content": "3+3?"}]
    td = steps(["x"] * 3, [1, 0, 5])
    write_objects(td, ("history", "prompt"), [chat_a, chat_b, chat_a_reordered])
    out = MCAdvantage(2, prompt_key=("history", "prompt"), mode="dr_grpo").add(td)
    assert out.shape == (2,) and out["step"].tolist() == [0, 2]
    close(out["advantage"][:, 0], [-2.0, 2.0])  # rewards 1 and 5 of chat a, mean 3
    assert prompt_group_key(chat_a) == prompt_group_key(chat_a_reordered) != prompt_group_key(chat_b)


def per_token_rewards():
    """Two trajectories (one step each) with per-token rewards over 3 valid tokens and one pad."""
    rewards = torch.tensor([[-0.1, -0.1, 1.0, 0.0], [-0.2, 0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, True, False], [True, True, True, False]])
    return rewards, mask


@pytest.mark.parametrize(
    "mode, expected",
    [
        # totals [0.8, -0.2], mean 0.3; returns [0.8, 0.9, 1.0] and [-0.2, 0, 0].
        ("dr_grpo", [[0.5, 0.6, 0.7], [-0.5, -0.3, -0.3]]),
        # baseline = the other row's total: -0.2 for row 0, 0.8 for row 1.
        ("rloo", [[1.0, 1.1, 1.2], [-1.0, -0.8, -0.8]]),
        # (returns - 0.3) / (std + eps), Bessel std of [0.8, -0.2] = sqrt(0.5).
        ("grpo", [[v / (math.sqrt(0.5) + 1e-6) for v in row] for row in [[0.5, 0.6, 0.7], [-0.5, -0.3, -0.3]]]),
    ],
)
def test_reward_to_go_hand_values(mode, expected):
    """Per-token rewards [-0.1, -0.1, 1] and [-0.2, 0, 0] (KL penalties, task reward last):
    each token's return minus the group baseline of the total returns (divided by their
    spread for grpo). The first token carries the sequence-level advantage of the totals."""
    rewards, mask = per_token_rewards()
    got = mc_group_advantages(rewards, torch.tensor([0, 0]), mask, mode=mode, reward_to_go=True)
    close(got[mask].reshape(2, 3), expected, atol=1e-12)
    assert got[~mask].eq(0).all()


def test_reward_to_go_constant_group_is_zero():
    """Both trajectories total 0.8: the group carries no signal and gets 0 everywhere."""
    rewards = torch.tensor([[0.4, 0.4], [0.0, 0.8]], dtype=F64)
    got = mc_group_advantages(rewards, torch.tensor([5, 5]), reward_to_go=True)
    assert got.eq(0).all()


def test_add_with_per_token_rewards_padded_and_jagged_agree():
    """The same per-token rewards stored padded ([1, T, 1] with the assistant mask) or jagged
    give the reward-to-go advantages of the hand test, in the reward's own layout. (tensordict
    < 0.15 cannot slice jagged entries: there the jagged batch gets an error naming the fix.)"""
    rewards, mask = per_token_rewards()
    expected = mc_group_advantages(rewards, torch.tensor([0, 0]), mask, mode="dr_grpo", reward_to_go=True)
    padded = steps(["p", "p"], [0, 0])
    padded["next", "reward"] = rewards[..., None]
    padded["masks", "all_assistant_mask"] = mask
    jagged = steps(["p", "p"], [0, 0])
    jagged["next", "reward"] = torch.nested.nested_tensor([r[m][:, None] for r, m in zip(rewards, mask)], layout=torch.jagged)
    out_padded = MCAdvantage(2, mode="dr_grpo", reward_to_go=True).add(padded)
    close(out_padded["advantage"][..., 0], expected, atol=1e-12)
    if not JAGGED_SLICING:
        with pytest.raises(ValueError, match=r"jagged \(nested\) entries.*mask_key"):
            MCAdvantage(2, mode="dr_grpo", reward_to_go=True).add(jagged)
        return
    out_jagged = MCAdvantage(2, mode="dr_grpo", reward_to_go=True).add(jagged)
    assert out_jagged["advantage"].is_nested
    close(torch.cat([a[:, 0] for a in out_jagged["advantage"].unbind()]), expected[mask], atol=1e-12)


def test_padded_per_token_rewards_need_their_mask():
    td = steps(["p", "p"], [0, 0])
    td["next", "reward"] = torch.zeros(2, 4, 1, dtype=F64)
    with pytest.raises(KeyError, match=r"all_assistant_mask.*valid-token mask"):
        MCAdvantage(2).add(td)


def test_vectorised_compute_matches_a_loop_over_groups():
    """Twelve scalar rewards in three groups of uneven size, labels out of order: compute()
    equals running each group on its own, for each mode."""
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, generator=gen, dtype=F64)
    groups = torch.tensor([7, 3, 7, 9, 3, 7, 9, 3, 7, 9, 9, 3])
    for mode in ("grpo", "dr_grpo", "rloo"):
        got = MCAdvantage(4, mode=mode).compute(rewards[:, None], groups)
        for label in (3, 7, 9):
            rows = groups == label
            alone = mc_group_advantages(rewards[rows], torch.zeros(int(rows.sum()), dtype=torch.long), mode=mode)
            close(got[rows, 0], alone, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        ({"grpo_size": 0}, ValueError, r"grpo_size: expected an int >= 2"),
        ({"grpo_size": 4, "mode": "ppo"}, ValueError, r"mode: expected one of .*'grpo'.*, got 'ppo'"),
        ({"grpo_size": 4, "std": "sample"}, ValueError, r"std: expected one of .*'unbiased'.*, got 'sample'"),
        ({"grpo_size": 1, "mode": "rloo"}, ValueError, r"grpo_size: expected an int >= 2"),
        # A group of one has no baseline: grpo and dr_grpo would emit 0 for ever.
        ({"grpo_size": 1}, ValueError, r"grpo_size: expected an int >= 2, got 1.*no baseline"),
        ({"grpo_size": 1, "mode": "dr_grpo"}, ValueError, r"grpo_size: expected an int >= 2"),
    ],
)
def test_bad_options(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        MCAdvantage(**kwargs)


def test_missing_keys_and_aliases():
    td = steps(["a"], [1])
    del td["next", "done"]
    with pytest.raises(KeyError, match=r"done.*missing.*Present keys"):
        MCAdvantage(2).add(td)
    mc = MCAdvantage(2)
    assert mc._inv_call(steps(["a"], [1])) is None
    td = mc.inv(steps(["a"], [0]))
    assert td is not None and mc(td) is td
