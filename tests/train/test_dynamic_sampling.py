"""Dynamic sampling (DAPO's): groups whose rewards differ are kept, extra draws come from their own
stretch of the problem stream and the seeded sampler, and a resumed run equals an uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch

from tests.train.test_recipe import interrupted_train, tiny_cfg
from tether.models.records import HeadHidden, StepRecord, group_ids
from tether.train.config import TrainConfig
from tether.train.recipe import build_run, step_problems, train
from tether.train.rewards import Rewards, informative, keep_informative, resampled_problems


def test_informative_groups_by_hand():
    """Groups of 3: (1, 1, 1) equal; (0, 1, 0) differ; (2, 2, 2) equal; (-1, -1, 5) differ."""
    rewards = torch.tensor([1.0, 1, 1, 0, 1, 0, 2, 2, 2, -1, -1, 5])
    assert informative(rewards, 3).tolist() == [False, True, False, True]


def _record(width: int, rows: int, tag: float) -> StepRecord:
    """``rows`` answers on a ``[rows, width]`` grid whose values name the row (tag + row)."""
    ids = torch.arange(rows * width).view(rows, width) + int(100 * tag)
    mask = torch.ones(rows, width, dtype=torch.bool)
    mask[:, -1] = False
    return StepRecord(tokens=ids, attention_mask=mask, assistant_mask=mask.clone(), group_ids=group_ids(rows, 2),
                      sample_log_probs=ids.double() / 7, responses=[f"{tag}-{i}" for i in range(rows)],
                      episode={"turns": torch.full((rows,), tag)})


def test_cat_then_take_equals_the_rows_written_out():
    """Records of widths 3 and 5 joined: the narrow one's rows gain two columns, masks False, ids and
    log-probs 0; ``take`` picks rows in the order given, across both records."""
    a, b = _record(3, 2, 1.0), _record(5, 4, 2.0)
    joined = StepRecord.cat([a, b]).take(torch.tensor([5, 0, 3]))
    expect_ids = torch.stack([b.tokens[3], torch.cat([a.tokens[0], torch.zeros(2, dtype=torch.long)]), b.tokens[1]])
    assert torch.equal(joined.tokens, expect_ids)
    assert joined.attention_mask.tolist()[1] == [True, True, False, False, False]
    assert torch.equal(joined.sample_log_probs[1], torch.cat([a.sample_log_probs[0], torch.zeros(2, dtype=torch.float64)]))
    assert joined.responses == ["2.0-3", "1.0-0", "2.0-1"] and joined.episode["turns"].tolist() == [2.0, 1.0, 2.0]


def test_the_references_hidden_states_follow_their_rows_through_cat_and_take():
    """Hidden states kept per assistant token (row-major, 2 per row of width 3, 4 per row of width 5;
    each vector names its row and position): after cat and take, row i's states are the source
    row's, in order, so a micro-batch cut (``rows``) reads the right ones. A part without them, or
    with another head, is refused."""
    def with_hidden(record: StepRecord, tag: float, weight: torch.Tensor) -> StepRecord:
        counts = record.assistant_mask.sum(-1)
        vectors = [torch.tensor([[tag, row, k]]) for row in range(len(record)) for k in range(int(counts[row]))]
        record.ref_hidden = HeadHidden(torch.cat(vectors), weight)
        return record

    head = torch.randn(7, 3)
    a, b = with_hidden(_record(3, 2, 1.0), 1.0, head), with_hidden(_record(5, 4, 2.0), 2.0, head.clone())
    joined = StepRecord.cat([a, b]).take(torch.tensor([5, 0, 3]))
    expected = [[2.0, 3, k] for k in range(4)] + [[1.0, 0, k] for k in range(2)] + [[2.0, 1, k] for k in range(4)]
    assert joined.ref_hidden.hidden.tolist() == expected
    assert joined.ref_hidden.weight is head
    assert joined.rows(1, 2).ref_hidden.hidden.tolist() == [[1.0, 0, 0], [1.0, 0, 1]]
    with pytest.raises(ValueError, match="'ref_hidden' is set in some records and not in others"):
        StepRecord.cat([a, _record(3, 2, 3.0)])
    with pytest.raises(ValueError, match="different output heads"):
        StepRecord.cat([a, with_hidden(_record(3, 2, 4.0), 4.0, head + 1)])


def _scripted_draws(rewards_per_draw: list[list[float]], seen: list):
    """A draw that records the problems it is given and returns a record of width 4 + draw index
    with the next scripted rewards."""
    def draw(problems):
        k = len(seen)
        seen.append(problems)
        record = _record(4 + k, len(problems), float(k))
        total = torch.tensor(rewards_per_draw[k])
        return record, Rewards(total, None, {"r": total.clone()})
    return draw


@pytest.mark.parametrize("max_resample, expected_groups, kept", [
    (4, [(0, 1), (2, 0)], 2),  # draw 0: (equal, differ); draw 1: (equal, equal); draw 2: (differ, equal)
    (1, [(0, 1), (0, 0)], 1),  # out of draws after draw 1: the differing group, then the first equal one
])
def test_keep_informative_keeps_differing_groups_in_draw_order(tmp_path, max_resample, expected_groups, kept):
    run = build_run(tiny_cfg(tmp_path / "run", dynamic_sampling=True, max_resample=max_resample))
    seen: list = []
    draws = [[1, 1, 1, 0, 1, 0], [0, 0, 0, 1, 1, 1], [0, 1, 1, 2, 2, 2]]
    problems, record, scores, metrics = keep_informative(run, 5, _scripted_draws(draws, seen), step_problems(run, 5))
    assert len(seen) == min(max_resample + 1, 3)
    assert seen[1] == resampled_problems(run, 5, 1)
    assert {p.key for p in seen[1]}.isdisjoint(p.key for p in seen[0])  # never the step's own prompts
    rows = [(d, g * 3 + i) for d, g in expected_groups for i in range(3)]
    assert problems == [seen[d][r] for d, r in rows]
    assert record.responses == [f"{float(d)}-{r}" for d, r in rows]
    assert scores.total.tolist() == [float(draws[d][r]) for d, r in rows]
    assert record.group_ids.tolist() == [0, 0, 0, 1, 1, 1] and record.tokens.shape[1] == 3 + len(seen)
    assert metrics == {"groups_drawn": 2.0 * len(seen), "groups_kept": float(kept)}


def test_off_draws_once_and_logs_nothing(tmp_path):
    run = build_run(tiny_cfg(tmp_path / "run"))
    seen: list = []
    *_, metrics = keep_informative(run, 0, _scripted_draws([[1.0] * 6], seen), step_problems(run, 0))
    assert len(seen) == 1 and metrics == {}


def test_a_run_logs_draws_and_resumes_bit_exact(tmp_path):
    """Equal rewards are common on the tiny model with a 0/1 reward (the count task's correctness
    through a reward function), so the run draws more than its 2 prompts; killed after step 2 and
    resumed, it logs the same values and ends on the same weights as the uninterrupted run."""
    reward_file = tmp_path / "reward.py"
    reward_file.write_text("def odd_majority(prompts, completions, **_):\n"
                           "    texts = [c[-1]['content'] for c in completions]  # chat completions: message lists\n"
                           "    return [float(sum(ord(c) % 2 for c in t) * 2 > len(t)) for t in texts]\n")
    kw = dict(steps=3, dynamic_sampling=True, max_resample=2, reward_funcs=str(reward_file), checkpoint_every=1)
    train(tiny_cfg(tmp_path / "whole", **kw), progress=False)
    interrupted_train(tiny_cfg(tmp_path / "cut", **kw), 2)
    train(TrainConfig.from_yaml(tmp_path / "cut" / "config.yaml"), resume=True, progress=False)
    lines = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    timing = {"step_time", "tokens_per_s", "kl_move_seconds"}
    assert [{k: v for k, v in r.items() if k not in timing} for r in lines] == [
        {k: v for k, v in r.items() if k not in timing} for r in again]
    for r in lines:
        assert r["groups_drawn"] in (2.0, 4.0, 6.0) and 0 <= r["groups_kept"] <= 2
    assert any(r["groups_drawn"] > 2 for r in lines)
    from safetensors.torch import load_file

    last = (tmp_path / "whole" / "checkpoints" / "latest").read_text()
    a = load_file(str(tmp_path / "whole" / "checkpoints" / last / "policy.safetensors"))
    b = load_file(str(tmp_path / "cut" / "checkpoints" / last / "policy.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
