"""The in-process pieces of tether.ray (no cluster): packing several requests into one grid,
merging worker batches, splitting groups over workers, per-worker seeds, the device check of
the actor bodies."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers import make_tiny_model, make_tokenizer
from tests.llm.naive import MULTI_TURN, PROMPTS
from tests.ray.factories import reference_scorer
from tether.llm import chat_batch
from tether.models import TransformersWrapper
from tether.ray import merge_batches, split_groups, worker_seed
from tether.ray._request_grid import join_requests, split_requests
from tether.ray.reference_service import BatchLimits, ReferenceServer
from tether.ray.transforms import ModelSpec, _build_kl_reward


def token_batch(chats, padding_side: str) -> tuple[torch.Tensor, torch.Tensor]:
    td = reference_scorer(padding_side=padding_side)(chat_batch(chats))
    return td["tokens", "full"], td["masks", "all_attention_mask"]


def test_one_packed_forward_equals_scoring_each_request():
    """A left-padded [3, T1] batch, a right-padded [3, T2] batch and a batch holding an empty
    row, packed into one [7, L] grid: one scoring call, split back, equals scoring each batch
    on its own (float64, 1e-10), with 0 on every position not sent as a token."""
    scorer = reference_scorer()
    left, right = token_batch(MULTI_TURN, "left"), token_batch(PROMPTS, "right")
    empty = (left[0][:1].clone(), torch.zeros_like(left[1][:1]))
    requests = [left, right, empty]
    packed = join_requests(requests)
    assert packed.ids.shape == (7, int(left[1].sum(-1).max()))
    assert torch.equal(packed.mask.sum(-1), torch.cat([m.sum(-1) for _, m in requests]))
    parts = split_requests(scorer.score(packed.ids, packed.mask).log_probs, packed)
    for part, (tokens, mask) in zip(parts, requests):
        assert part.shape == tokens.shape
        # score_tokens returns float32 zeros for a batch without a single scored token
        torch.testing.assert_close(part, scorer.score(tokens, mask).log_probs, rtol=0, atol=1e-10, check_dtype=False)
        assert torch.all(part[~mask] == 0)
    assert parts[0][left[1]].lt(-1e-3).any()


def sampled(chats, seed: int):
    tok = make_tokenizer()
    sampler = TransformersWrapper(make_tiny_model(tok), tok, generate_kwargs={
        "max_new_tokens": 4 + seed, "generator": torch.Generator().manual_seed(seed)})
    return sampler(chat_batch(chats, key=("history", "prompt")))


def test_merge_keeps_every_row_and_the_left_padded_layout():
    """Two sampled batches of different widths: the merged batch keeps each row's valid tokens,
    log-probs and masks in order, is left-padded (last column valid in every row) with the pad
    id under the padding, and joins texts and chats."""
    parts = [sampled(PROMPTS[:2], 0), sampled(PROMPTS, 1)]
    assert parts[0]["tokens", "full"].shape[1] != parts[1]["tokens", "full"].shape[1]
    merged = merge_batches(parts, pad_id=259)
    mask = merged["masks", "all_attention_mask"]
    assert merged.batch_size == torch.Size([5]) and bool(mask[:, -1].all())
    assert torch.all(merged["tokens", "full"][~mask] == 259)
    rows = [(td, i) for td in parts for i in range(td.batch_size[0])]
    for r, (td, i) in enumerate(rows):
        own = td["masks", "all_attention_mask"][i]
        for key in (("tokens", "full"), ("log_probs", "full"), ("masks", "all_assistant_mask")):
            assert torch.equal(merged[key][r][mask[r]], td[key][i][own]), key
        for key in (("tokens", "response"), ("log_probs", "response")):
            width = td[key].shape[1]
            assert torch.equal(merged[key][r, -width:], td[key][i]), key
    assert torch.equal(merged["response_truncated"], torch.cat([p["response_truncated"] for p in parts]))
    texts = [p["text", "response"].tolist() for p in parts]
    assert merged["text", "response"].tolist() == texts[0] + texts[1]
    assert merged["history", "prompt"].tolist() == PROMPTS[:2] + PROMPTS
    del parts[1]["text"]
    with pytest.raises(ValueError, match=r"batches\[1\]: expected the keys of batches\[0\]"):
        merge_batches(parts, pad_id=259)


def test_groups_are_split_into_contiguous_runs():
    assert split_groups(3, 2) == [range(0, 2), range(2, 3)]
    assert split_groups(12, 5) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10), range(10, 12)]
    assert split_groups(1, 3) == [range(0, 1), range(1, 1), range(1, 1)]


def test_worker_seeds_are_fixed_and_distinct():
    """blake2b of (seed, step, worker): values pinned so a change (e.g. to Python's salted
    hash()) cannot slip in and break reproducibility across processes."""
    assert worker_seed(0, 0, 0) == 8598450131790618887
    seeds = {worker_seed(s, t, w) for s in range(3) for t in range(3) for w in range(3)}
    assert len(seeds) == 27 and all(0 <= s < 2**63 for s in seeds)


def test_a_scorer_pinned_to_another_device_is_refused_where_the_actor_builds_it():
    """The service's actor body (built here, in-process) applies the transforms' device check:
    a wrapper built with device="meta" would keep sending its inputs there, not to "cpu"."""
    pinned = functools.partial(reference_scorer, device="meta")
    with pytest.raises(ValueError, match="device='cpu': the scorer was built with device='meta'"):
        ReferenceServer(None, pinned, BatchLimits(), torch.device("cpu"), 4)
    with pytest.raises(ValueError, match="device='cpu': the scorer was built with device='meta'"):
        _build_kl_reward(ModelSpec(ref_model_factory=pinned), {}, torch.device("cpu"))
    server = ReferenceServer(None, reference_scorer, BatchLimits(), torch.device("cpu"), 4)
    assert server.info().weights_version is None and server.scorer.device.type == "cpu"
