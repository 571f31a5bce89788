"""RetrieveLogProb: parity with full-logit log-probs, masks, layouts, exact tokens, grads, errors."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.helpers import CHATML, make_tiny_model, make_tokenizer
from tests.llm.naive import MULTI_TURN, PROMPTS, naive_logprobs, rows, token_rows
from tether.llm import KLRewardTransform, RetrieveKL, RetrieveLogProb, chat_batch
from tether.models import TransformersWrapper
from tether.models.batch_io import write_objects


@pytest.fixture
def setup():
    tok = make_tokenizer()
    return tok, make_tiny_model(tok, dtype=torch.float64)


def scorer(tok, model, **kw):
    return TransformersWrapper(model, tok, generate=False, **kw)


@pytest.mark.parametrize("assistant_only", [True, False])
def test_matches_full_logit_logprobs_on_multi_turn_chats(setup, assistant_only):
    """Each row equals log_softmax(full logits) gathered at the next token (float64, 1e-10),
    zeroed outside the assistant mask when assistant_only."""
    tok, model = setup
    td = RetrieveLogProb(scorer(tok, model), assistant_only=assistant_only)(chat_batch(MULTI_TURN))
    assistant = rows(td, ("masks", "all_assistant_mask"))
    for ids, lp, asst in zip(token_rows(td), rows(td, ("log_probs", "full")), assistant):
        expected = naive_logprobs(model, ids)
        if assistant_only:
            expected = torch.where(asst, expected, 0.0)
        torch.testing.assert_close(lp, expected, rtol=0, atol=1e-10)


def test_assistant_mask_covers_each_turn_and_its_end_token(setup):
    """Decoding the masked tokens gives every assistant turn followed by <|im_end|>; the
    mask has one run per assistant turn, each ending on the eos id (258)."""
    tok, model = setup
    td = RetrieveLogProb(scorer(tok, model))(chat_batch(MULTI_TURN))
    for chat, ids, asst in zip(MULTI_TURN, token_rows(td), rows(td, ("masks", "all_assistant_mask"))):
        turns = [m["content"] for m in chat if m["role"] == "assistant"]
        assert tok.decode(ids[asst]) == "".join(t + "<|im_end|>" for t in turns)
        ends = asst & ~torch.cat([asst[1:], asst.new_zeros(1)])
        assert ends.sum() == len(turns)
        assert torch.all(ids[ends] == tok.eos_token_id)


def test_layouts_give_identical_values(setup):
    """pad_output True/False and padding_side left/right: same tokens and log-probs per row."""
    tok, model = setup
    results = []
    for pad_output in (True, False):
        for side in ("left", "right"):
            module = RetrieveLogProb(scorer(tok, model, pad_output=pad_output), padding_side=side)
            td = module(chat_batch(MULTI_TURN))
            if pad_output:
                valid = td["masks", "all_attention_mask"]
                assert bool(valid[:, -1 if side == "left" else 0].all())
            results.append((token_rows(td), rows(td, ("log_probs", "full"))))
    ref_ids, ref_lp = results[0]
    for ids, lp in results[1:]:
        for a, b in zip(ids, ref_ids):
            assert torch.equal(a, b)
        for a, b in zip(lp, ref_lp):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", ["left", "right", "nested"])
def test_scores_the_tokens_already_in_the_batch(setup, layout):
    """With ("tokens", "full") and its mask present, those ids are scored as they are and the
    history is not re-rendered: the history here says something else entirely."""
    tok, model = setup
    id_rows = [torch.tensor(tok(t)["input_ids"]) for t in ["abcde", "xy", "hello world"]]
    asst_rows = [torch.arange(len(r)) >= 1 for r in id_rows]  # "xy" keeps one assistant token
    td = TensorDict(batch_size=[3])
    write_objects(td, ("history", "full"), [[{"role": "user", "content": "unrelated"}]] * 3)
    if layout == "nested":
        td["tokens", "full"] = torch.nested.nested_tensor(id_rows, layout=torch.jagged)
        td["masks", "all_attention_mask"] = torch.nested.nested_tensor(
            [torch.ones(len(r), dtype=torch.bool) for r in id_rows], layout=torch.jagged)
        td["masks", "all_assistant_mask"] = torch.nested.nested_tensor(asst_rows, layout=torch.jagged)
    else:
        pad = torch.nn.utils.rnn.pad_sequence
        td["tokens", "full"] = pad(id_rows, batch_first=True, padding_value=259, padding_side=layout)
        td["masks", "all_attention_mask"] = pad([torch.ones(len(r), dtype=torch.bool) for r in id_rows],
                                                batch_first=True, padding_side=layout)
        td["masks", "all_assistant_mask"] = pad(asst_rows, batch_first=True, padding_side=layout)
    before = td["tokens", "full"].clone() if layout != "nested" else None
    td = RetrieveLogProb(scorer(tok, model))(td)
    for ids, asst, lp in zip(id_rows, asst_rows, rows(td, ("log_probs", "full"))):
        torch.testing.assert_close(lp, torch.where(asst, naive_logprobs(model, ids), 0.0), rtol=0, atol=1e-10)
    if before is not None:
        assert torch.equal(td["tokens", "full"], before)
        assert td["log_probs", "full"].shape == before.shape


def test_writes_into_next_and_keeps_tokens_at_the_root(setup):
    """Log-probs go to td["next"]; tokens and masks stay at the root, aligned with them."""
    tok, model = setup
    td = chat_batch(MULTI_TURN)
    td["next"] = TensorDict(batch_size=[3])
    td = RetrieveLogProb(scorer(tok, model), log_probs_full_key=("ref", "full"))(td)
    assert ("ref", "full") not in td.exclude("next").keys(True)
    mask, asst = td["masks", "all_attention_mask"], td["masks", "all_assistant_mask"]
    for ids, lp, m, a in zip(td["tokens", "full"], td["next", "ref", "full"], mask, asst):
        expected = torch.where(a[m], naive_logprobs(model, ids[m]), 0.0)
        torch.testing.assert_close(lp[m], expected, rtol=0, atol=1e-10)
        assert torch.all(lp[~m] == 0)


def test_detach_true_builds_no_graph(setup):
    tok, model = setup
    with torch.enable_grad():
        td = RetrieveLogProb(scorer(tok, model), detach=True)(chat_batch(MULTI_TURN))
    assert td["log_probs", "full"].grad_fn is None and not td["log_probs", "full"].requires_grad


def test_detach_false_keeps_the_gradient_of_the_naive_computation(setup):
    """d/dW of the summed assistant log-probs equals the same gradient through full logits."""
    tok, model = setup
    td = RetrieveLogProb(scorer(tok, model), detach=False)(chat_batch(MULTI_TURN))
    td["log_probs", "full"].sum().backward()
    fast = model.lm_head.weight.grad.clone()
    model.zero_grad()
    total = sum(
        torch.where(asst, naive_logprobs(model, ids), 0.0).sum()
        for ids, asst in zip(token_rows(td), rows(td, ("masks", "all_assistant_mask")))
    )
    total.backward()
    torch.testing.assert_close(fast, model.lm_head.weight.grad, rtol=0, atol=1e-9)


def test_text_mode_scores_through_the_wrapper(setup):
    """Text input (assistant_only=False, as text carries no assistant turns): the wrapper
    locates the response after ("text", "prompt") and writes its mask; every token is scored."""
    tok, model = setup
    td = TensorDict(batch_size=[2])
    write_objects(td, ("text", "prompt"), ["Q: 1+1?\nA:", "hello"])
    write_objects(td, ("text", "full"), ["Q: 1+1?\nA: 2", "hello world"])
    td = RetrieveLogProb(scorer(tok, model, input_mode="text"), assistant_only=False)(td)
    asst = rows(td, ("masks", "all_assistant_mask"))
    assert [tok.decode(i[a]) for i, a in zip(token_rows(td), asst)] == [" 2", " world"]
    for ids, lp in zip(token_rows(td), rows(td, ("log_probs", "full"))):
        torch.testing.assert_close(lp, naive_logprobs(model, ids), rtol=0, atol=1e-10)


def test_tokenizer_kwargs_reach_the_chat_template():
    """A template variable passed through tokenizer_kwargs changes what is rendered."""
    tok = make_tokenizer("{{ greeting | default('') }}" + CHATML)
    model = make_tiny_model(tok, dtype=torch.float64)
    td = RetrieveLogProb(scorer(tok, model), tokenizer_kwargs={"greeting": "HEY"})(chat_batch(MULTI_TURN[:1]))
    assert tok.decode(token_rows(td)[0]).startswith("HEY<|im_start|>user")


def test_assistant_only_with_text_is_refused_at_construction(setup):
    """TorchRL refuses this at construction, where the user can fix it; so does tether (it used
    to fail only at call time with a KeyError). RetrieveKL and KLRewardTransform pass it on.
    A tokens-mode model is accepted (the mask comes from the batch; see
    tests/llm/test_torchrl_ported.py)."""
    tok, model = setup
    input_mode = "text"
    pattern = rf"assistant_only=True needs a model with input_mode='history'.*got input_mode='{input_mode}'.*assistant_only=False"
    with pytest.raises(ValueError, match=pattern):
        RetrieveLogProb(scorer(tok, model, input_mode=input_mode))
    reference = scorer(tok, model, input_mode=input_mode, log_probs_key="ref_log_probs")
    with pytest.raises(ValueError, match=pattern):
        RetrieveKL(None, reference)
    with pytest.raises(ValueError, match=pattern):
        KLRewardTransform(reference)


def test_assistant_only_without_a_mask_is_refused(setup):
    tok, model = setup
    ids = torch.tensor([tok("abc")["input_ids"]])
    td = TensorDict({("tokens", "full"): ids, ("masks", "all_attention_mask"): ids > -1}, batch_size=[1])
    module = RetrieveLogProb(scorer(tok, model))
    with pytest.raises(KeyError, match="all_assistant_mask.*assistant_only=False"):
        module(td)
    out = RetrieveLogProb(scorer(tok, model, input_mode="tokens"), assistant_only=False)(td)
    torch.testing.assert_close(out["log_probs", "full"][0], naive_logprobs(model, ids[0]), rtol=0, atol=1e-10)


def test_errors(setup):
    tok, model = setup
    with pytest.raises(ValueError, match="configured to generate.*generate=False"):
        RetrieveLogProb(TransformersWrapper(model, tok, generate=True))
    with pytest.raises(ValueError, match="return_log_probs"):
        RetrieveLogProb(scorer(tok, model, return_log_probs=False))
    with pytest.raises(TypeError, match="TransformersWrapper"):
        RetrieveLogProb(model)
    with pytest.raises(ValueError, match="padding_side"):
        RetrieveLogProb(scorer(tok, model), padding_side="middle")
    with pytest.raises(TypeError, match="log_probs_full_key"):
        RetrieveLogProb(scorer(tok, model), log_probs_full_key=3)
    other = make_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="vocabularies.*261.*260"):
        RetrieveLogProb(scorer(tok, model), tokenizer=other)
    with pytest.raises(ValueError, match="tokenizer_kwargs may not set"):
        RetrieveLogProb(scorer(tok, model), tokenizer_kwargs={"tokenize": False})(chat_batch(MULTI_TURN))
    with pytest.raises(KeyError, match="history.*full"):
        RetrieveLogProb(scorer(tok, model))(chat_batch(PROMPTS, key=("history", "prompt")))
