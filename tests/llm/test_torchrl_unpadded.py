"""TorchRL's KL-transform tests on its own data and batch construction, unpadded included.

TorchRL 0.14.1's ``test/llm/test_wrapper.py::TestKLTransforms`` builds its batches in a given
order: the chats (its ``sample_history_assistant``: 92 and 226 byte tokens here) made a lazy
stack with ``to_lazystack(0)``; both scorers run on that same stack, the second on a batch the
first has already written tokens into; an empty ``TensorDict(batch_size=(2,)).to_lazystack(0)``
is filled with ``update(..., keys_to_update=[...])`` from the scorers' outputs and a
``[2, 1, 1]`` reward, then attached with ``data.set("next", ...)``. The tests below make the
batches the same way (``chat_batch`` for TorchRL's ``ChatHistory``) and check values against
full-logit log-probs. tether's one documented change: RetrieveKL on a batch without a reward
takes ``add_to_reward=False`` (TorchRL adds nothing there; tether names the missing key).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.helpers import make_tiny_model, make_tokenizer
from tests.llm.naive import naive_logprobs
from tether.llm import KLComputation, RetrieveKL, chat_batch
from tether.models import TransformersWrapper, tokenize_chats
from tether.models.batch_io import get_entry, write_objects

# TorchRL's sample_history_assistant and sample_text.
CHATS = [
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Are you happy? Say yes or no."},
     {"role": "assistant", "content": "Yes."}],
    [{"role": "system", "content": "You are a very helpful assistant, but more handsome."},
     {"role": "user", "content": "Explain the difference between a cat and a dog. Be very detailed."},
     {"role": "assistant", "content": "A cat is a small animal that meows, while a dog is a larger animal that barks."}],
]
TEXTS = ["Are you happy? Say yes or no.", "Explain the difference between a cat and a dog. Be very detailed."]
GEN, REF = ("gen_log_probs", "full"), ("ref_log_probs", "full")
LAYOUTS = pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])


@pytest.fixture(scope="module")
def models():
    tok = make_tokenizer()
    return tok, make_tiny_model(tok, dtype=torch.float64), make_tiny_model(tok, dtype=torch.float64, seed=1)


def wrapper(tok, model, mode, pad_output, key):
    return TransformersWrapper(model, tokenizer=tok, input_mode=mode, generate=False, return_log_probs=True,
                               pad_output=pad_output, log_probs_key=key)


def naive_rows(tok, model, mode, assistant_only):
    """Each row's log-probs from full logits: the rendered chat (0 off the assistant turn with
    ``assistant_only``) or the text / token ids."""
    if mode == "history":
        enc = tokenize_chats(tok, CHATS)
        return [naive_logprobs(model, ids) * (mask if assistant_only else 1)
                for ids, mask in zip(enc.input_ids, enc.assistant_mask)]
    return [naive_logprobs(model, torch.tensor(tok(t).input_ids)) for t in TEXTS]


def valid(td, key, attention):
    """Row ``i``'s valid entries: a lazy stack's own row, or a padded row under its mask."""
    value = get_entry(td, key)
    if value.is_nested:
        return list(value.unbind())
    return [v[m.bool()] for v, m in zip(value, attention)]


def close(got, want):
    assert [g.numel() for g in got] == [w.numel() for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.reshape(w.shape).double(), w, rtol=0, atol=1e-9)


@LAYOUTS
def test_kl_computation_transform(models, pad_output):
    """Row lengths 92 and 226. kl = log pi - log pi_ref on each row (0 off the assistant turn:
    the scorers write the assistant mask the KL is taken on), and the reward r_b [2, 1, 1] becomes
    r_b - kl per token of its row (coeff 1)."""
    tok, policy, reference = models
    data = chat_batch(CHATS).to_lazystack(0)
    gen_result = wrapper(tok, policy, "history", pad_output, "gen_log_probs")(data)
    ref_result = wrapper(tok, reference, "history", pad_output, "ref_log_probs")(data)
    next_td = TensorDict(batch_size=(2,)).to_lazystack(0)
    next_td.update(gen_result, keys_to_update=[GEN])
    next_td.update(ref_result, keys_to_update=[REF])
    reward = torch.tensor([0.5, -2.0], dtype=torch.float64)
    next_td.update({"reward": reward.reshape(2, 1, 1)})
    result = KLComputation(gen_log_probs_full_key=GEN, ref_log_probs_full_key=REF, kl_key="kl",
                           add_to_reward=True, coeff=1.0)(data.set("next", next_td))
    attention = get_entry(result, ("masks", "all_attention_mask"))
    out = result["next"]
    assert len(out.get("kl", as_list=True)) == 2
    kl = [g - r for g, r in zip(naive_rows(tok, policy, "history", True), naive_rows(tok, reference, "history", True))]
    assert [k.numel() for k in kl] == [92, 226]
    close(valid(out, "kl", attention), kl)
    close(valid(out, "reward", attention), [r - k for r, k in zip(reward, kl)])


def batch_for(tok, mode):
    """TorchRL's three inputs: chats, strings, or its left-padded ``sample_tokens`` with their mask."""
    if mode == "history":
        return chat_batch(CHATS)
    td = TensorDict(batch_size=(2,))
    if mode == "text":
        write_objects(td, ("text", "full"), TEXTS)
        return td
    enc = tok(TEXTS, return_tensors="pt", padding=True, padding_side="left")
    td["tokens", "full"] = enc["input_ids"]
    td["masks", "all_attention_mask"] = enc["attention_mask"].bool()
    return td


@LAYOUTS
@pytest.mark.parametrize("assistant_only", [True, False], ids=["assistant_only", "all_tokens"])
@pytest.mark.parametrize("input_mode", ["history", "text", "tokens"])
def test_retrieve_kl_input_modes(models, pad_output, assistant_only, input_mode):
    """The batch becomes a lazy stack just before RetrieveKL; per row, kl_penalty is the
    difference of the two full-logit rows and the generator's log-probs are its own."""
    if assistant_only and input_mode != "history":
        pytest.skip("assistant_only=True needs input_mode='history' (refused at construction, as in TorchRL)")
    tok, policy, reference = models
    transform = RetrieveKL(
        gen_model=wrapper(tok, policy, input_mode, pad_output, "gen_log_probs"),
        ref_model=wrapper(tok, reference, input_mode, pad_output, "ref_log_probs"),
        assistant_only=assistant_only, tokenizer=tok, gen_log_probs_full_key=GEN, ref_log_probs_full_key=REF,
        add_to_reward=False,
    )
    data = batch_for(tok, input_mode).to_lazystack(0)
    result = transform(data)
    assert GEN in result and REF in result and "kl_penalty" in result
    kl = result.get("kl_penalty", as_list=not pad_output)
    assert len(kl) == 2
    attention = get_entry(result, ("masks", "all_attention_mask"))
    gen = naive_rows(tok, policy, input_mode, assistant_only)
    ref = naive_rows(tok, reference, input_mode, assistant_only)
    close(valid(result, "kl_penalty", attention), [g - r for g, r in zip(gen, ref)])
    close(valid(result, GEN, attention), gen)
