"""ReferenceService: concurrent callers share one batched forward pass and get their own rows;
a service killed with a request queued comes back and scores every request exactly once, with
the right values; a request the forward pass would fail on is refused alone while its
batch-mates are answered; a service that cannot be placed, or does not answer, times out with
the reason."""

from __future__ import annotations

import collections
import functools
import os
import time

import pytest
import ray
import torch

from tests.llm.naive import MULTI_TURN, PROMPTS
from tests.ray import factories
from tests.ray.factories import reference_scorer
from tether.llm import chat_batch
from tether.ray import ReferenceClient, ReferenceService, ScoreRequest

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]


def token_batch(chats, padding_side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and attention mask of ``chats`` laid out with ``padding_side`` padding."""
    td = reference_scorer(padding_side=padding_side)(chat_batch(chats))
    return td["tokens", "full"], td["masks", "all_attention_mask"]


def local_log_probs(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference_scorer().score(tokens, mask).log_probs


@ray.remote(num_cpus=0.5)
def rollout_worker(client, tokens, mask):
    """Stands in for a rollout worker: one request to the shared service."""
    return client.submit(tokens, mask).reply(timeout_s=120)


def test_concurrent_callers_share_one_forward_and_get_their_own_rows():
    """Two Ray tasks send a left-padded [3, T1] and a right-padded [3, T2] batch at once; the
    service packs both into one forward pass (forward_calls == 1, both replies from pass 1)
    and each caller gets log-probs equal to scoring its own batch locally (1e-6)."""
    left = token_batch(MULTI_TURN, "left")
    right = token_batch(PROMPTS, "right")
    assert left[0].shape[1] != right[0].shape[1]
    service = ReferenceService(ref_model_factory=reference_scorer, max_wait_ms=60_000, max_batch_rows=6)
    try:
        client = service.client()
        replies = ray.get([rollout_worker.remote(client, *left), rollout_worker.remote(client, *right)])
        assert service.forward_calls() == 1
        assert [r.forward_index for r in replies] == [1, 1]
        assert len({r.request_id for r in replies}) == 2
        for reply, (tokens, mask) in zip(replies, (left, right)):
            expected = local_log_probs(tokens, mask)
            assert reply.log_probs.shape == tokens.shape
            torch.testing.assert_close(reply.log_probs, expected, rtol=0, atol=1e-6)
            assert expected[mask].lt(-1e-3).any()  # real log-probs, not a grid of zeros
        stats = service.stats()
        assert (stats.requests_scored, stats.rows_scored) == (2, 6)
    finally:
        service.shutdown()


def test_a_tokenizers_integer_mask_scores_like_the_bool_mask():
    """Guarantees promise 0/1 integer masks (a tokenizer's int64 attention mask): the client sends
    it as bool, so the reply equals the bool mask's reply bit for bit and local scoring (1e-6)."""
    tokens, mask = token_batch(PROMPTS, "left")
    service = ReferenceService(ref_model_factory=reference_scorer, max_wait_ms=0)
    try:
        client = service.client()
        as_int, as_bool = client.score(tokens, mask.long()), client.score(tokens, mask)
        assert torch.equal(as_int, as_bool)
        torch.testing.assert_close(as_int, local_log_probs(tokens, mask), rtol=0, atol=1e-6)
    finally:
        service.shutdown()


def distinct_requests(names: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Three left-padded rows per name, every row's tokens distinct from every other's."""
    chats = [[{"role": "user", "content": f"question {name}{i}"}] for name in names for i in range(3)]
    tokens, mask = token_batch(chats, "left")
    return {name: (tokens[3 * k : 3 * k + 3], mask[3 * k : 3 * k + 3]) for k, name in enumerate(names)}


def wait_until(condition, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie not yet reaped counts as gone: it runs nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_service_killed_with_a_request_queued_scores_every_request_exactly_once(tmp_path):
    """Requests A and B (one group of 6 rows) are scored together. C opens a second group of 6
    rows and is confirmed queued at the service (not yet scored) when ray.kill(no_restart=False)
    hits; D, the rest of C's group, is sent once the old process is gone, while the actor
    restarts (ray.kill returns before the process exits: a D sent at once can reach the old
    instance, complete the group there and be scored, and Ray then rightly retries C and D on
    the new instance, which is "at most once per instance", not once in all). The factory builds the model
    again in the new process, which scores C (resubmitted by Ray) and D in one forward pass as
    soon as the group is complete, not after max_wait_ms (60 s). The scorer's log, which outlives
    both instances, names every request exactly once, and every caller got its own rows, equal
    to local scoring (1e-6). Then: a resent answered id comes from the cache, a reused id with
    other tokens is refused, flush() closes a group that will never fill, and a service killed
    for good makes the client give up after max_attempts with the cause."""
    requests = distinct_requests("ABCDE")
    id_by_row = {}
    for name, (tokens, mask) in requests.items():
        id_by_row.update({tuple(row[keep].tolist()): name for row, keep in zip(tokens, mask)})
    scored, builds = tmp_path / "scored.txt", tmp_path / "builds.txt"
    factory = functools.partial(factories.logging_scorer, str(scored), id_by_row)
    service = ReferenceService(ref_model_factory=functools.partial(built_logged, factory, str(builds)),
                               max_wait_ms=60_000)
    try:
        client = service.client(retry_delay_s=0.2)
        first = {n: client.submit(*requests[n], request_id=n, group="g1", group_rows=6) for n in "AB"}
        replies = {n: p.reply(timeout_s=120) for n, p in first.items()}
        before = service.stats()
        started = time.monotonic()
        pending = {"C": client.submit(*requests["C"], request_id="C", group="g2", group_rows=6)}
        wait_until(lambda: service.stats().queued_ids == ["C"], "C to be queued at the service")
        ray.kill(service.actor, no_restart=False)
        wait_until(lambda: process_gone(before.pid), "the killed service process to exit")
        pending["D"] = client.submit(*requests["D"], request_id="D", group="g2", group_rows=6)
        replies.update({n: p.reply(timeout_s=120) for n, p in pending.items()})
        elapsed = time.monotonic() - started
        after = service.stats()

        assert (before.forward_calls, before.queued_ids) == (1, [])
        assert after.pid != before.pid and after.forward_calls == 1 and elapsed < 30
        assert len(builds.read_text().splitlines()) == 2
        assert [replies[n].service_pid for n in "ABCD"] == [before.pid] * 2 + [after.pid] * 2
        assert collections.Counter(scored.read_text().split()) == {n: 1 for n in "ABCD"}
        for name, reply in replies.items():
            assert reply.request_id == name
            torch.testing.assert_close(reply.log_probs, local_log_probs(*requests[name]), rtol=0, atol=1e-6)

        repeat = client.send(pending["D"].request)  # answered by this instance: from its cache
        assert ray.get(repeat).request_id == "D"
        cached = service.stats()
        assert (cached.forward_calls, cached.repeats_answered) == (1, after.repeats_answered + 1)
        reused = client.submit(*[t.flip(0) for t in requests["D"]], request_id="D")
        with pytest.raises(ValueError, match="already taken by another batch"):
            reused.reply(timeout_s=60)

        lonely = client.submit(*requests["E"], request_id="E", group="g3", group_rows=9)
        wait_until(lambda: service.stats().queued_ids == ["E"], "E to be queued")
        assert service.flush() == 1
        assert lonely.reply(timeout_s=30).forward_index == 2
        assert service.flush() == 0  # nothing queued: no wake left behind for the next batch

        assert service.load_weights({}, version="v7") == 0
        assert service.info().weights_version == "v7"
        with pytest.raises(KeyError, match="not parameters of the service's reference"):
            service.load_weights({"no.such.weight": torch.zeros(1)})
    finally:
        service.shutdown()
    service.shutdown()  # a second call does nothing
    # Killed for good: the client resends up to max_attempts, then says what failed.
    gone = service.client(max_attempts=2, retry_delay_s=0).submit(*requests["A"])
    with pytest.raises(RuntimeError, match=r"failed 2 times \(ActorDiedError\).*max_restarts"):
        gone.reply(timeout_s=60)
    assert gone.attempts == 2
    assert collections.Counter(scored.read_text().split()) == {n: 1 for n in "ABCDE"}


def built_logged(factory, log_path: str):
    """``factory()``, after appending this process's pid to ``log_path`` (one line per build)."""
    with open(log_path, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    return factory()


def test_a_service_that_cannot_be_placed_times_out_with_the_reason():
    """64 CPUs on a 2-CPU cluster: Ray would keep the actor pending for ever, so the constructor
    refuses at once (well inside the 300 s default wait) and names what the cluster has."""
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"ReferenceService: the actor asked for .*'num_cpus': 64.0.*whole Ray cluster "
                                         r"has \{'CPU': 2.0.*could never be placed"):
        ReferenceService(ref_model_factory=reference_scorer, num_cpus=64)
    assert time.monotonic() - start < 60


def test_a_request_with_ids_past_the_vocabulary_fails_alone():
    """Three Ray tasks send requests A, B, C of one group (9 rows) at once; B holds the id V, one
    past the reference's vocabulary of V ids, at an unmasked position. B alone fails, with a
    ValueError naming the bound [0, V) and the bad id's row and position. B's rows count as
    arrived, so A and C are scored together in the group's one forward pass without waiting out
    max_wait_ms (120 s), and equal local scoring (1e-6). A's masked-out position holding -100 is
    never scored, so it is accepted. Malformed requests that bypass the client's checks are
    refused by the service with a TypeError; a hand-built request's 0/1 integer mask is read as
    bool, as the client reads it."""
    vocab = reference_scorer().model.get_input_embeddings().num_embeddings
    requests = distinct_requests("ABC")
    tokens_a, mask_a = (t.clone() for t in requests["A"])
    tokens_a[~mask_a] = -100
    tokens_b, mask_b = (t.clone() for t in requests["B"])
    row, col = 1, int(mask_b[1].nonzero()[-1])
    tokens_b[row, col] = vocab
    sent = {"A": (tokens_a, mask_a), "B": (tokens_b, mask_b), "C": requests["C"]}
    service = ReferenceService(ref_model_factory=reference_scorer, max_wait_ms=120_000)
    try:
        client = service.client()
        refs = {n: group_member.options(num_cpus=0.25).remote(client, *sent[n], n) for n in "ABC"}
        bad = rf"request 'B': token ids under the mask must lie in \[0, {vocab}\).*at row {row}, position {col}"
        with pytest.raises(ValueError, match=bad):
            ray.get(refs["B"], timeout=60)
        replies = {n: ray.get(refs[n], timeout=60) for n in "AC"}
        assert [replies[n].forward_index for n in "AC"] == [1, 1] and service.forward_calls() == 1
        for name, reply in replies.items():
            torch.testing.assert_close(reply.log_probs, local_log_probs(*requests[name]), rtol=0, atol=1e-6)
        assert sorted(service.stats().answered_ids) == ["A", "C"]  # B was never queued

        float_mask = ScoreRequest("float-mask", tokens_a, mask_a.double())
        with pytest.raises(TypeError, match=r"mask must be a bool \(or 0/1 integer\) mask, got dtype torch.float64"):
            ray.get(client.send(float_mask), timeout=60)
        int_mask = ScoreRequest("int-mask", tokens_a, mask_a.long(), "int", tokens_a.shape[0])  # a whole group: no wait
        reply = ray.get(client.send(int_mask), timeout=60)
        torch.testing.assert_close(reply.log_probs, local_log_probs(*requests["A"]), rtol=0, atol=1e-6)
        with pytest.raises(TypeError, match="request: expected a tether.ray.ScoreRequest.*got str"):
            ray.get(service.actor.score.remote("tokens"), timeout=60)
    finally:
        service.shutdown()


def test_a_batch_whose_forward_fails_is_scored_again_request_by_request():
    """A scorer that fails on one token id (valid, so the arrival checks pass it): A and C are
    clean, B holds that id; the three form one group, so one joint forward pass, which fails.
    The service then scores each alone: B gets the scorer's error, A and C their log-probs
    (equal to local scoring, 1e-6) from the first and second successful passes."""
    requests = distinct_requests("ABC")
    clean = {int(i) for n in "AC" for i in requests[n][0][requests[n][1]]}
    bad_token = min({int(i) for i in requests["B"][0][requests["B"][1]]} - clean)  # "B" itself, say
    service = ReferenceService(ref_model_factory=functools.partial(factories.picky_scorer, bad_token),
                               max_wait_ms=120_000)
    try:
        client = service.client()
        pending = {n: client.submit(*requests[n], request_id=n, group="g", group_rows=9) for n in "ABC"}
        with pytest.raises(RuntimeError, match=f"cannot score token {bad_token}"):
            pending["B"].reply(timeout_s=60)
        replies = {n: pending[n].reply(timeout_s=60) for n in "AC"}
        assert [replies[n].forward_index for n in "AC"] == [1, 2] and service.forward_calls() == 2
        for name, reply in replies.items():
            torch.testing.assert_close(reply.log_probs, local_log_probs(*requests[name]), rtol=0, atol=1e-6)
    finally:
        service.shutdown()


@ray.remote(num_cpus=0.5)
def group_member(client, tokens, mask, request_id):
    """A rollout worker sending its part of the 9-row group "g"."""
    return client.submit(tokens, mask, request_id=request_id, group="g", group_rows=9).reply(timeout_s=120)


def test_a_reply_that_never_comes_times_out_with_what_was_awaited():
    """A group that never fills and max_wait_ms of 120 s: the client's timeout_s (1 s, given to
    service.client) bounds the wait, and the error names the request and the knob to raise."""
    tokens, mask = distinct_requests("A")["A"]
    service = ReferenceService(ref_model_factory=reference_scorer, max_wait_ms=120_000)
    try:
        pending = service.client(timeout_s=1).submit(tokens, mask, request_id="lonely", group="g", group_rows=99)
        with pytest.raises(TimeoutError, match=r"request 'lonely' to the reference service: no answer after 1 s.*timeout_s"):
            pending.reply()
        assert service.flush() == 1
    finally:
        service.shutdown()


def test_request_errors_name_the_argument():
    client = ReferenceClient(actor=None)  # the checks run before anything is sent
    tokens, mask = token_batch(PROMPTS, "left")
    with pytest.raises(ValueError, match=r"tokens/mask: expected two \[B, T\] tensors of the same shape"):
        client.submit(tokens, mask[:, 1:])
    with pytest.raises(TypeError, match=r"mask must be a bool \(or 0/1 integer\) mask, got dtype torch.float64"):
        client.submit(tokens, mask.double())
    with pytest.raises(ValueError, match=r"mask must hold only 0 and 1, got values in \[0, 2\]"):
        client.submit(tokens, mask.long() * 2)
    with pytest.raises(ValueError, match="max_attempts: expected an int >= 1"):
        ReferenceClient(actor=None, max_attempts=0)
    with pytest.raises(ValueError, match="group='g', group_rows=None: expected both or neither"):
        client.submit(tokens, mask, group="g")
    with pytest.raises(ValueError, match=r"group_rows: expected an int >= 3, got .*at least this request's 3"):
        client.submit(tokens, mask, group="g", group_rows=2)
    with pytest.raises(ValueError, match="ready_timeout_s: expected a finite number > 0"):
        ReferenceService(ref_model_factory=reference_scorer, ready_timeout_s=0)
    with pytest.raises(ValueError, match="timeout_s: expected a finite number > 0, got inf"):
        ReferenceService(ref_model_factory=reference_scorer, timeout_s=float("inf"))
    with pytest.raises(ValueError, match="timeout_s: expected a finite number > 0, got 0"):
        ReferenceClient(actor=None, timeout_s=0)
    with pytest.raises(ValueError, match="max_wait_ms: expected a finite number >= 0, got -1"):
        ReferenceService(ref_model_factory=reference_scorer, max_wait_ms=-1)
    with pytest.raises(ValueError, match="max_batch_rows: expected an int >= 1, got 0. Pass None for no limit"):
        ReferenceService(ref_model_factory=reference_scorer, max_batch_rows=0)
    with pytest.raises(ValueError, match="max_restarts: expected an int >= -1"):
        ReferenceService(ref_model_factory=reference_scorer, max_restarts=-2)
