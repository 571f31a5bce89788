"""``MultiTurnRollout``: turn-by-turn episodes with tool turns, their ends, budgets and stats.

A scripted policy (``sample_turn`` replaced by fixed replies) checks the mechanics exactly:
with the byte-level tokenizer, the token-first conversation must equal the chat template's
rendering of the final chat, and its assistant mask the template-derived mask. A real tiny
model checks that the recorded log-probs are those of every sampled token across turns.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.helpers import make_tokenizer
from tests.models.test_sampling import eos_biased_model
from tests.llm.naive import naive_logprobs
from tether.models import TransformersWrapper, tokenize_chats
from tether.models.batch_io import write_objects
from tether.models.chat import render_chat_ids
from tether.rollout import MultiTurnRollout, ParsedCall, episode_metrics

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
SCRIPT = {  # question -> assistant replies, turn by turn
    "Q0": [CALL % "12*34", "It is 408."],
    "Q1": ["408"],
    "Q2": ['<tool_call>{"name": "nope"}</tool_call>', "oops <tool_call>x", "still no"],
    "Q3": [CALL % "1+1", CALL % "2+2", CALL % "3+3"],
}


def prompts(*questions):
    td = TensorDict({}, batch_size=[len(questions)])
    write_objects(td, ("history", "prompt"), [[{"role": "user", "content": q}] for q in questions])
    return td


class Scripted(MultiTurnRollout):
    """Replies from ``SCRIPT`` with log-prob -0.5 per token; records each turn's batch size."""

    batches: list[int]

    def sample_turn(self, rows, limits):
        tok = self.policy.tokenizer
        self.batches = getattr(self, "batches", []) + [len(rows)]
        out = []
        for row, limit in zip(rows, limits):
            text = tok.decode(row)
            question = next(q for q in SCRIPT if f"user\n{q}" in text)
            turn = text.count("<|im_start|>assistant") - 1
            ids = tok(SCRIPT[question][turn])["input_ids"] + [tok.eos_token_id]
            out.append((ids[:limit], [-0.5] * min(len(ids), limit), len(ids) <= limit))
        return out


def scripted(max_turns=3, max_tokens=None, max_new_tokens=200):
    tok = make_tokenizer()
    wrapper = TransformersWrapper(eos_biased_model(tok), tok, generate_kwargs={"max_new_tokens": max_new_tokens})
    return Scripted(wrapper, max_turns=max_turns, max_tokens=max_tokens), tok


def test_episodes_match_the_template_rendering_of_the_final_chat():
    rollout, tok = scripted()
    td = rollout(prompts("Q0", "Q1", "Q2", "Q3"))
    assert rollout.batches == [4, 3, 2]  # finished conversations leave the batch
    chats = td["history", "full"].tolist()
    assert chats[0][1:] == [
        {"role": "assistant", "content": CALL % "12*34"}, {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "It is 408."}]
    assert chats[2][2]["content"] == "Error: no tool named 'nope'; available: ['calculator']"
    assert chats[2][4]["content"] == "Error: <tool_call> is not closed by </tool_call>"
    # Q3 calls on its 3rd turn too, but max_turns=3: that call is not run.
    assert [m["content"] for m in chats[3] if m["role"] == "tool"] == ["2", "4"]
    assert td["episode", "end"].tolist() == ["answer", "answer", "answer", "max_turns"]
    assert td["episode", "turns"].tolist() == [2, 1, 3, 3]
    assert td["episode", "tool_calls"].tolist() == [1, 0, 2, 2]
    assert td["episode", "tool_errors"].tolist() == [0, 0, 2, 0]
    assert td["text", "response"].tolist() == ["It is 408.", "408", "still no", CALL % "3+3"]
    assert not td["response_truncated"].any()
    reference = tokenize_chats(tok, chats)
    attn, ids, mask = td["masks", "all_attention_mask"], td["tokens", "full"], td["masks", "all_assistant_mask"]
    ids, mask = (x.flip(-1) for x in (ids, mask))  # left-padded: realign rows on the right
    attn = attn.flip(-1)
    for i, (ref_ids, ref_mask) in enumerate(zip(reference.input_ids, reference.assistant_mask)):
        # ChatML ends every turn with "<|im_end|>\n"; the episode stops at the eos.
        n = len(ref_ids) - 1
        assert int(attn[i].sum()) == n
        assert ids[i, :n].flip(-1).tolist() == ref_ids[:-1].tolist()
        assert mask[i, :n].flip(-1).tolist() == ref_mask[:-1].tolist()
    lp = td["log_probs", "full"]
    assert torch.all(lp[td["masks", "all_assistant_mask"]] == -0.5) and torch.all(lp[~td["masks", "all_assistant_mask"]] == 0)
    assert episode_metrics(td["episode"]) == {"tool_call_rate": 0.75, "tool_calls_per_episode": 1.25,
                                   "tool_error_rate": 0.4, "turns_per_episode": 2.25}


def test_token_budget_and_length_ends():
    rollout, tok = scripted(max_tokens=60)
    prompt_len = len(render_chat_ids(tok, [{"role": "user", "content": "Q0"}], add_generation_prompt=True))
    td = rollout(prompts("Q0"))
    # The first reply (74 ids + eos) is cut at the budget: 60 - prompt_len tokens.
    assert td["episode", "end"].tolist() == ["token_budget"] and bool(td["response_truncated"][0])
    assert int(td["masks", "all_assistant_mask"].sum()) == 60 - prompt_len
    assert int(td["masks", "all_attention_mask"].sum()) == 60 and td["episode", "tool_calls"].tolist() == [0]
    short, _ = scripted(max_new_tokens=3)
    td = short(prompts("Q1", "Q0"))
    # "408" + eos is 4 ids: both replies stop at 3 tokens without an end-of-turn.
    assert td["episode", "end"].tolist() == ["length", "length"]
    assert td["masks", "all_assistant_mask"].sum(-1).tolist() == [3, 3]


def test_budget_reached_after_a_tool_turn():
    rollout, tok = scripted()
    first = rollout(prompts("Q0"))
    after_tool = len(render_chat_ids(tok, first["history", "full"].tolist()[0][:3], add_generation_prompt=True))
    tight, _ = scripted(max_tokens=after_tool)
    td = tight(prompts("Q0"))
    assert td["episode", "end"].tolist() == ["token_budget"] and td["episode", "tool_calls"].tolist() == [1]
    assert int(td["masks", "all_attention_mask"].sum()) == after_tool


def test_real_model_records_exact_log_probs_across_turns():
    """Every sampled token of every turn carries log p(x_t | x_<t) of the full conversation
    (float64 model, full re-run); tool and template tokens carry 0 and are outside the mask."""
    tok = make_tokenizer()
    model = eos_biased_model(tok, p_eos=0.3).double()
    wrapper = TransformersWrapper(model, tok, temperature=0.8, generate_kwargs={
        "max_new_tokens": 8, "generator": torch.Generator().manual_seed(1)})
    always = lambda text: [ParsedCall("calculator", {"expression": "2+3"})]  # noqa: E731
    rollout = MultiTurnRollout(wrapper, max_turns=3, tool_format=always)
    td = rollout(prompts("a", "bb", "ccc", "dddd"))
    ended = td["episode", "end"].tolist()
    assert "max_turns" in ended and set(ended) <= {"max_turns", "length"}
    for i in range(4):
        valid = td["masks", "all_attention_mask"][i]
        ids, mask = td["tokens", "full"][i][valid], td["masks", "all_assistant_mask"][i][valid]
        expected = naive_logprobs(model, ids, temperature=0.8)
        recorded = td["log_probs", "full"][i][valid].double()
        torch.testing.assert_close(recorded[mask], expected[mask], rtol=0, atol=1e-5)
        assert torch.all(recorded[~mask] == 0)
        turns, calls = int(td["episode", "turns"][i]), int(td["episode", "tool_calls"][i])
        text = tok.decode(ids[~mask])
        assert text.count("<|im_start|>tool\n5<|im_end|>") == calls == (turns - 1)
        # Runs of assistant tokens: one per turn.
        starts = (mask[1:] & ~mask[:-1]).sum()
        assert int(starts) == turns


def _fed_tokens(model):
    """A counter of the real (unpadded) tokens each forward call reads, and its hook handle."""
    fed = [0]

    def count(module, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        fed[0] += int(mask[:, -ids.shape[1]:].sum())

    return fed, model.register_forward_pre_hook(count, with_kwargs=True)


@pytest.mark.parametrize("kv_cache", [True, False])
def test_a_kept_cache_reads_each_token_once_and_samples_the_same_episodes(kv_cache):
    """Three turns, a tool call after each of the first two. With the cache kept, the model reads
    every token of each final conversation once, except its last sampled token (never fed back):
    sum(len - 1) tokens in all. Prefilling each turn again reads more. Both sample the same
    episodes from the same seed (float64; HF's RMSNorm rounds in float32, hence 1e-6)."""
    tok = make_tokenizer()
    model = eos_biased_model(tok, p_eos=0.3).double()
    always = lambda text: [ParsedCall("calculator", {"expression": "2+3"})]  # noqa: E731

    def episodes(cache):
        wrapper = TransformersWrapper(model, tok, temperature=0.8, generate_kwargs={
            "max_new_tokens": 8, "generator": torch.Generator().manual_seed(1)})
        return MultiTurnRollout(wrapper, max_turns=3, tool_format=always, kv_cache=cache)(
            prompts("a", "bb", "ccc", "dddd"))

    fed, hook = _fed_tokens(model)
    try:
        td = episodes(kv_cache)
    finally:
        hook.remove()
    lengths = td["masks", "all_attention_mask"].sum(-1)
    expected = int((lengths - 1).sum())
    assert fed[0] == expected if kv_cache else fed[0] > expected
    assert int(td["episode", "turns"].sum()) > 4  # some episode went past its first turn
    other = episodes(not kv_cache)
    assert torch.equal(td["tokens", "full"], other["tokens", "full"])
    torch.testing.assert_close(td["log_probs", "full"], other["log_probs", "full"], rtol=0, atol=1e-6)


def test_bad_arguments():
    tok = make_tokenizer()
    model = eos_biased_model(tok)
    with pytest.raises(TypeError, match=r"policy: expected a TransformersWrapper\(.*input_mode='tokens'"):
        MultiTurnRollout(TransformersWrapper(model, tok, input_mode="tokens"))
    wrapper = TransformersWrapper(model, tok)
    with pytest.raises(ValueError, match="max_turns: expected an int >= 1, got 0"):
        MultiTurnRollout(wrapper, max_turns=0)
    with pytest.raises(ValueError, match="tool_role"):
        MultiTurnRollout(wrapper, tool_role="")
    with pytest.raises(ValueError, match="tool_format: expected one of .*, got 'xml'"):
        MultiTurnRollout(wrapper, tool_format="xml")
    with pytest.raises(ValueError, match=r"max_tokens=5 leaves no room to answer prompt 0, which renders to \d+ tokens"):
        MultiTurnRollout(wrapper, max_tokens=5)(prompts("hello"))
    with pytest.raises(KeyError, match=r"\('history', 'prompt'\)"):
        MultiTurnRollout(wrapper)(TensorDict({}, batch_size=[1]))
