"""TransformersWrapper: keys, on-policy consistency, layouts, masks, pad == eos, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict

from tether.models import TransformersWrapper
from tether.models.batch_io import write_objects
from tests.helpers import CHATML_GENERATION, make_tiny_model, make_tokenizer

CHATS = [
    [{"role": "user", "content": "What is 2+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Say something long please"}],
]
FULL_CHATS = [
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "bc"},
        {"role": "user", "content": "d"},
        {"role": "assistant", "content": "efg"},
    ],
]


def chat_td(chats, stage):
    td = TensorDict(batch_size=[len(chats)])
    write_objects(td, ("history", stage), chats)
    return td


def naive_full_logprobs(model, ids, temperature=1.0):
    """Aligned log-probs of one unpadded row from the model's full logits."""
    logits = model(input_ids=ids[None]).logits[0, :-1].double() / temperature
    lp = F.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)
    return torch.cat([lp.new_zeros(1), lp])


@pytest.fixture
def setup():
    tok = make_tokenizer()
    model = make_tiny_model(tok, dtype=torch.float64)
    return tok, model


def generate(tok, model, **kw):
    gen_kw = {"max_new_tokens": 8, "generator": torch.Generator().manual_seed(0)}
    return TransformersWrapper(model, tok, generate=True, temperature=0.8, generate_kwargs=gen_kw, **kw)


def test_generation_is_consistent_with_scoring(setup):
    """Sampling log-probs equal a fresh scoring of the same tokens (ratio 1 on-policy)."""
    tok, model = setup
    td = generate(tok, model)(chat_td(CHATS, "prompt"))
    mask = td["masks", "all_attention_mask"]
    scorer = TransformersWrapper(model, tok, input_mode="tokens", generate=False, temperature=0.8)
    scored = scorer(TensorDict({("tokens", "full"): td["tokens", "full"],
                                ("masks", "all_attention_mask"): mask}, batch_size=[3]))
    asst = td["masks", "all_assistant_mask"]
    torch.testing.assert_close(td["log_probs", "full"][asst], scored["log_probs", "full"][asst].float(),
                               rtol=0, atol=1e-5)
    assert torch.all(td["log_probs", "full"][~asst] == 0)


def test_generation_keys_and_structure(setup):
    tok, model = setup
    td = generate(tok, model)(chat_td(CHATS, "prompt"))
    full, mask = td["tokens", "full"], td["masks", "all_attention_mask"]
    prompt, resp = td["tokens", "prompt"], td["tokens", "response"]
    for i in range(3):
        p = prompt[i][prompt[i] != tok.pad_token_id]
        r = td["tokens", "response"][i][: int(td["masks", "all_assistant_mask"][i].sum())]
        assert torch.equal(full[i][mask[i]], torch.cat([p, r]))
        # left padding: valid tokens are flush right
        assert bool(mask[i, -1])
        # the history gains the decoded assistant answer
        hist = td["history", "full"][i] if isinstance(td["history", "full"], list) else td.get(("history", "full")).tolist()[i]
        assert hist[-1] == {"role": "assistant", "content": td.get(("text", "response")).tolist()[i]}
    assert resp.shape[1] <= 8
    assert td["log_probs", "response"].shape == resp.shape


def test_pad_output_and_padding_side_do_not_change_values(setup):
    tok, model = setup
    outs = []
    for pad_output in (True, False):
        for side in ("left", "right"):
            w = generate(tok, model, pad_output=pad_output, padding_side=side)
            td = w(chat_td(CHATS, "prompt"))
            lp, tokens = td["log_probs", "full"], td["tokens", "full"]
            if pad_output:
                m = td["masks", "all_attention_mask"]
                outs.append(([t[mm] for t, mm in zip(tokens, m)], [x[mm] for x, mm in zip(lp, m)]))
            else:
                outs.append((list(tokens.unbind()), list(lp.unbind())))
    ref_tokens, ref_lp = outs[0]
    for tokens, lp in outs[1:]:
        for a, b in zip(tokens, ref_tokens):
            assert torch.equal(a, b)
        for a, b in zip(lp, ref_lp):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("template", ["chatml", "generation"])
def test_history_scoring_masks_and_values(template):
    tok = make_tokenizer(CHATML_GENERATION) if template == "generation" else make_tokenizer()
    model = make_tiny_model(tok, dtype=torch.float64)
    w = TransformersWrapper(model, tok, generate=False)
    td = w(chat_td(FULL_CHATS, "full"))
    mask, asst = td["masks", "all_attention_mask"], td["masks", "all_assistant_mask"]
    for i, chat in enumerate(FULL_CHATS):
        ids = td["tokens", "full"][i][mask[i]]
        expected = naive_full_logprobs(model, ids)
        torch.testing.assert_close(td["log_probs", "full"][i][mask[i]].double(), expected, rtol=0, atol=1e-10)
        answer = "".join(m["content"] + "<|im_end|>" for m in chat if m["role"] == "assistant")
        assert tok.decode(td["tokens", "full"][i][asst[i]]) == answer


def test_text_mode_locates_response(setup):
    tok, model = setup
    td = TensorDict(batch_size=[2])
    write_objects(td, ("text", "prompt"), ["Q: 1+1?\nA:", "hello"])
    write_objects(td, ("text", "full"), ["Q: 1+1?\nA: 2", "hello world"])
    w = TransformersWrapper(model, tok, input_mode="text", generate=False)
    td = w(td)
    asst = td["masks", "all_assistant_mask"]
    assert [tok.decode(r[m]) for r, m in zip(td["tokens", "full"], asst)] == [" 2", " world"]
    torch.testing.assert_close(td["log_probs", "response"].sum(-1), (td["log_probs", "full"] * asst).sum(-1))


def test_tokens_mode_nested_input_equals_padded(setup):
    tok, model = setup
    rows = [torch.tensor(tok(t)["input_ids"]) for t in ["abc", "hello there", "z"]]
    nested = torch.nested.nested_tensor(rows, layout=torch.jagged)
    w = TransformersWrapper(model, tok, input_mode="tokens", generate=False, pad_output=False)
    out = w(TensorDict({("tokens", "full"): nested}, batch_size=[3]))
    for i, row in enumerate(rows):
        torch.testing.assert_close(out["log_probs", "full"][i].double(), naive_full_logprobs(model, row),
                                   rtol=0, atol=1e-10)


def test_pad_equal_eos_keeps_eos_logprob():
    """With pad == eos the final eos of each response is scored and inside the mask."""
    tok = make_tokenizer(pad_is_eos=True)
    model = make_tiny_model(tok, dtype=torch.float64)
    w = TransformersWrapper(model, tok, generate=False)
    td = w(chat_td(FULL_CHATS, "full"))
    for i in range(2):
        asst = td["masks", "all_assistant_mask"][i]
        last = asst.nonzero().max()
        assert td["tokens", "full"][i, last] == tok.eos_token_id
        assert td["log_probs", "full"][i, last] < 0


def test_scoring_honours_grad_mode(setup):
    tok, model = setup
    w = TransformersWrapper(model, tok, generate=False)
    with torch.no_grad():
        assert not w(chat_td(FULL_CHATS, "full"))["log_probs", "full"].requires_grad
    assert w(chat_td(FULL_CHATS, "full"))["log_probs", "full"].requires_grad


def test_errors(setup):
    tok, model = setup
    with pytest.raises(ValueError, match="input_mode"):
        TransformersWrapper(model, tok, input_mode="chat")
    with pytest.raises(ValueError, match="tokenizer"):
        TransformersWrapper(model, None, input_mode="history")
    with pytest.raises(ValueError, match="generate_kwargs.*beams"):
        TransformersWrapper(model, tok, generate_kwargs={"beams": 2})
    with pytest.raises(ValueError, match="temperature"):
        TransformersWrapper(model, tok, temperature=0.0)
    w = TransformersWrapper(model, tok, generate=False)
    with pytest.raises(KeyError, match="history.*full"):
        w(TensorDict(batch_size=[1]))
    with pytest.raises(KeyError, match="role"):
        w(chat_td([[{"content": "x"}]], "full"))


@pytest.mark.parametrize("input_mode", ["history", "text"])
def test_sample_record_equals_the_tensordict_path(setup, input_mode):
    """The step's path (``sample_record``: Python prompts in, a ``StepRecord`` out) draws exactly what
    ``forward`` writes to a TensorDict from the same prompts and generator seed: the same tokens,
    masks and sampling log-probs bit for bit, the same answer texts, and the given groups. A third of
    the vocabulary ends an answer, so rows end at different steps and the re-layout is exercised."""
    tok, model = setup
    ends = list(range(0, model.config.vocab_size, 3))
    prompts = CHATS if input_mode == "history" else ["2+3=", "Hi there", "Say something long please"]
    if input_mode == "history":
        td = chat_td(prompts, "prompt")
    else:
        td = TensorDict(batch_size=[len(prompts)])
        write_objects(td, ("text", "prompt"), prompts)
    generate(tok, model, input_mode=input_mode, eos_token_id=ends)(td)
    groups = torch.tensor([0, 0, 1])
    record = generate(tok, model, input_mode=input_mode, eos_token_id=ends).sample_record(prompts, groups)
    assert torch.equal(record.tokens, td["tokens", "full"])
    assert torch.equal(record.attention_mask, td["masks", "all_attention_mask"])
    assert torch.equal(record.assistant_mask, td["masks", "all_assistant_mask"])
    assert torch.equal(record.sample_log_probs, td["log_probs", "full"])
    assert record.responses == list(td["text", "response"])
    assert torch.equal(record.group_ids, groups)
    lengths = record.assistant_mask.sum(-1)
    assert lengths.min() >= 1 and len(set(lengths.tolist())) > 1  # answers of several lengths: not vacuous


def test_sample_record_refuses_a_tokens_mode_wrapper(setup):
    tok, model = setup
    wrapper = TransformersWrapper(model, tok, input_mode="tokens", generate=True)
    with pytest.raises(ValueError, match="sample_record: prompts are chats .*input_mode='tokens'"):
        wrapper.sample_record([[1, 2, 3]])
