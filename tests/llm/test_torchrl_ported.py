"""TorchRL's tests of its LLM KL transforms, on tether's API.

Ported from ``test/llm/test_wrapper.py::TestKLTransforms`` and ``test/llm/test_llm_envs.py``
(``test_chat_env_kl``). Tiny random models and the byte tokenizer replace Qwen; tether's
documented changes apply (``chat_batch`` for chats, ``add_to_reward=False`` on a batch without
a reward). Every test checks values against full-logit recomputations (``naive_logprobs``).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from tests.helpers import make_tiny_model, make_tokenizer
from tests.llm.naive import naive_logprobs, rows, token_rows
from tether.llm import KLComputation, KLRewardTransform, RetrieveKL, RetrieveLogProb, chat_batch
from tether.models import TransformersWrapper, tokenize_chats
from tether.models.batch_io import get_entry, write_objects

CHATS = [
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Are you happy? Say yes or no."},
     {"role": "assistant", "content": "Yes."}],
    [{"role": "system", "content": "You are a very helpful assistant, but more handsome."},
     {"role": "user", "content": "Explain the difference between a cat and a dog."},
     {"role": "assistant", "content": "A cat meows, a dog barks."}],
]
TEXTS = ["Are you happy? Say yes or no.", "Explain the difference between a cat and a dog."]
GEN, REF = ("gen_log_probs", "full"), ("ref_log_probs", "full")
MODES = [("history", True), ("history", False), ("text", False), ("tokens", False)]


@pytest.fixture(scope="module")
def models():
    tok = make_tokenizer()
    return tok, make_tiny_model(tok, dtype=torch.float64), make_tiny_model(tok, dtype=torch.float64, seed=1)


def scorer(tok, model, mode, pad_output, key):
    return TransformersWrapper(model, tok, input_mode=mode, generate=False, pad_output=pad_output, log_probs_key=key)


def batch_for(tok, mode):
    """TorchRL's three inputs: chats, strings, or left-padded token ids with their mask."""
    if mode == "history":
        return chat_batch(CHATS)
    td = TensorDict(batch_size=[2])
    if mode == "text":
        write_objects(td, ("text", "full"), TEXTS)
        return td
    enc = tok(TEXTS, padding=True, padding_side="left", return_tensors="pt")
    td["tokens", "full"] = enc.input_ids
    td["masks", "all_attention_mask"] = enc.attention_mask.bool()
    return td


def expected_rows(tok, model, mode, assistant_only):
    """Per-row reference log-probs: the rendered chat (assistant tokens only if asked) or text."""
    if mode == "history":
        enc = tokenize_chats(tok, CHATS)
        out = []
        for ids, mask in zip(enc.input_ids, enc.assistant_mask):
            lp = naive_logprobs(model, ids)
            out.append(lp * mask if assistant_only else lp)
        return out
    return [naive_logprobs(model, torch.tensor(tok(t).input_ids)) for t in TEXTS]


def valid_rows(td, key):
    """The valid entries of each row, whether ``td`` is a lazy stack or not, padded or jagged."""
    value = get_entry(td, key)
    if value.is_nested:
        return list(value.unbind())
    return [v[m] for v, m in zip(value, get_entry(td, ("masks", "all_attention_mask")).bool())]


def assert_rows(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.reshape(w.shape).double(), w, rtol=0, atol=1e-9)


@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize(("input_mode", "assistant_only"), MODES)
def test_retrieve_log_prob_input_modes(models, pad_output, input_mode, assistant_only):
    """Ports ``TestKLTransforms::test_retrieve_log_prob_input_modes``: every input mode, both
    layouts; the log-probs of each row equal the full-logit ones (zero outside the assistant
    turn with ``assistant_only``)."""
    tok, _, reference = models
    module = RetrieveLogProb(scorer(tok, reference, input_mode, pad_output, "log_probs"),
                             assistant_only=assistant_only, tokenizer=tok)
    out = module(batch_for(tok, input_mode))
    assert out.get(("log_probs", "full")).is_nested == (not pad_output and input_mode != "tokens")
    assert_rows(rows(out, ("log_probs", "full")), expected_rows(tok, reference, input_mode, assistant_only))


@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize(("input_mode", "assistant_only"), MODES)
def test_retrieve_kl_input_modes_on_a_lazy_stack(models, pad_output, input_mode, assistant_only):
    """Ports ``TestKLTransforms::test_retrieve_kl_input_modes``: the batch is made a lazy stack
    (``to_lazystack(0)``) before RetrieveKL runs; the KL of each row is the difference of the
    two full-logit log-prob rows (on the assistant turn with ``assistant_only``)."""
    tok, policy, reference = models
    module = RetrieveKL(
        scorer(tok, policy, input_mode, pad_output, "gen_log_probs"),
        scorer(tok, reference, input_mode, pad_output, "ref_log_probs"),
        assistant_only=assistant_only, tokenizer=tok, gen_log_probs_full_key=GEN, ref_log_probs_full_key=REF,
        add_to_reward=False,
    )
    out = module(batch_for(tok, input_mode).to_lazystack(0))
    gen = expected_rows(tok, policy, input_mode, assistant_only)
    ref = expected_rows(tok, reference, input_mode, assistant_only)
    assert_rows(valid_rows(out, "kl_penalty"), [g - r for g, r in zip(gen, ref)])
    assert_rows(valid_rows(out, GEN), gen)


def test_assistant_only_validation(models):
    """Ports ``test_retrieve_log_prob_assistant_only_validation`` and
    ``test_retrieve_kl_assistant_only_validation``: a text-mode model with assistant_only=True
    is refused at construction, naming input_mode and the fix."""
    tok, policy, reference = models
    pattern = r"assistant_only=True needs a model with input_mode='history'.*got input_mode='text'.*assistant_only=False"
    with pytest.raises(ValueError, match=pattern):
        RetrieveLogProb(scorer(tok, reference, "text", True, "ref_log_probs"), tokenizer=tok)
    with pytest.raises(ValueError, match=pattern):
        RetrieveKL(scorer(tok, policy, "text", True, "gen_log_probs"), scorer(tok, reference, "text", True, "ref_log_probs"))


@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
def test_retrieve_kl_pad_output_consistency(models, pad_output):
    """Ports ``test_retrieve_kl_pad_output_consistency``: scorers of different layouts are refused."""
    tok, policy, reference = models
    with pytest.raises(ValueError, match="pad_output mismatch"):
        RetrieveKL(scorer(tok, policy, "history", pad_output, "gen_log_probs"),
                   scorer(tok, reference, "history", not pad_output, "ref_log_probs"), assistant_only=False)


@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
def test_kl_computation_transform(models, pad_output):
    """Ports ``test_kl_computation_transform``: both scorers run on a lazy stack, their log-probs
    and a reward ``[B, 1, 1]`` go to a lazily stacked ``"next"``; KLComputation writes
    ``kl = log pi - log pi_ref`` on the assistant tokens and ``reward - kl`` per token."""
    tok, policy, reference = models
    data = chat_batch(CHATS).to_lazystack(0)
    gen = scorer(tok, policy, "history", pad_output, "gen_log_probs")(data)
    ref = scorer(tok, reference, "history", pad_output, "ref_log_probs")(data)
    nxt = TensorDict(batch_size=(2,)).to_lazystack(0)
    nxt.update(gen, keys_to_update=[GEN])
    nxt.update(ref, keys_to_update=[REF])
    reward = torch.tensor([0.5, -2.0], dtype=torch.float64)
    nxt.update({"reward": reward.reshape(2, 1, 1)})
    data.update(gen.select(("masks", "all_assistant_mask"), ("masks", "all_attention_mask")))
    out = KLComputation(GEN, REF, kl_key="kl", coeff=1.0)(data.set("next", nxt))["next"]
    kl = [g - r for g, r in zip(expected_rows(tok, policy, "history", True), expected_rows(tok, reference, "history", True))]
    out.update(data.select(("masks", "all_attention_mask")))
    assert_rows(valid_rows(out, "kl"), kl)
    assert_rows(valid_rows(out, "reward"), [(r - k)[:, None] for r, k in zip(reward, kl)])


# --------------------------------------------------------------------------- rollouts [envs, steps]
def rollout_of_lazy_stacks(tok, policy, reference, pad_output):
    """A ``[2 envs, 2 steps]`` batch as TorchRL's rollouts hold it: a lazy stack (over steps)
    of lazy stacks (over envs) of unpadded rows, each with its ``("next", "reward")``."""
    chats = CHATS + [c[:2] + [{"role": "assistant", "content": "No!"}] for c in CHATS]
    scored = RetrieveKL(scorer(tok, policy, "history", False, "gen_log_probs"),
                        scorer(tok, reference, "history", False, "ref_log_probs"),
                        gen_log_probs_full_key=GEN, ref_log_probs_full_key=REF, add_to_reward=False)(chat_batch(chats))
    keys = [("tokens", "full"), ("masks", "all_attention_mask"), ("masks", "all_assistant_mask")]
    cells = []
    for i in range(4):
        cell = TensorDict({key: rows(scored, key)[i] for key in keys}, batch_size=[])
        cell["next"] = TensorDict({"reward": torch.tensor([float(i)], dtype=torch.float64)}, batch_size=[])
        cells.append(cell)
    steps = [lazy_stack([cells[step], cells[step + 2]]) for step in range(2)]
    expected_kl = [rows(scored, GEN)[i] - rows(scored, REF)[i] for i in range(4)]
    return lazy_stack(steps, dim=1), cells, expected_kl


@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("kind", ["RetrieveKL", "KLComputation"])
def test_kl_on_a_rollout_of_lazy_stacks(models, pad_output, kind):
    """Unpadded rows of a ``[envs, steps]`` rollout, stored as a lazy stack of lazy stacks (as
    TorchRL's rollouts and collectors lay them out for ``pad_output=False``). tensordict refuses
    to read their per-token entries at once ("Failed to stack tensors"), which stopped both
    components; now each row gets the KL of its own tokens and ``reward - 0.5 * kl``."""
    tok, policy, reference = models
    td, cells, kl = rollout_of_lazy_stacks(tok, policy, reference, pad_output)
    gen = scorer(tok, policy, "history", pad_output, "gen_log_probs")
    ref = scorer(tok, reference, "history", pad_output, "ref_log_probs")
    if kind == "RetrieveKL":
        module = RetrieveKL(gen, ref, gen_log_probs_full_key=GEN, ref_log_probs_full_key=REF, coeff=0.5)
    else:
        td = RetrieveLogProb(ref, log_probs_full_key=REF)(RetrieveLogProb(gen, log_probs_full_key=GEN)(td))
        module = KLComputation(GEN, REF, coeff=0.5)
    out = module(td)
    assert out is td and td.batch_size == (2, 2)
    for i, cell in enumerate(cells):
        torch.testing.assert_close(cell["next", "kl_penalty"].double(), kl[i], rtol=0, atol=1e-9)
        torch.testing.assert_close(cell["next", "reward"].double().squeeze(-1), i - 0.5 * kl[i], rtol=0, atol=1e-9)


def test_kl_on_a_rollout_of_padded_steps(models):
    """A padded rollout: a lazy stack over steps of dense ``[envs]`` steps, each padded to its
    own width. Each step is scored on its own; the KL of every row is that of its tokens."""
    tok, policy, reference = models
    _, cells, kl = rollout_of_lazy_stacks(tok, policy, reference, True)
    steps = []
    for pair in (cells[0:2], cells[2:4]):
        width = max(c["tokens", "full"].numel() for c in pair)
        pad = lambda v, fill: torch.nn.functional.pad(v, (0, width - v.numel()), value=fill)  # noqa: E731
        steps.append(TensorDict({
            ("tokens", "full"): torch.stack([pad(c["tokens", "full"], tok.pad_token_id) for c in pair]),
            ("masks", "all_attention_mask"): torch.stack([pad(c["masks", "all_attention_mask"], False) for c in pair]),
            ("masks", "all_assistant_mask"): torch.stack([pad(c["masks", "all_assistant_mask"], False) for c in pair]),
        }, batch_size=[2]))
    td = lazy_stack(steps, dim=1)
    RetrieveKL(scorer(tok, policy, "history", True, "gen_log_probs"), scorer(tok, reference, "history", True,
               "ref_log_probs"), gen_log_probs_full_key=GEN, ref_log_probs_full_key=REF, add_to_reward=False)(td)
    for step, pair in enumerate(((0, 1), (2, 3))):
        for row, i in enumerate(pair):
            got = valid_rows(steps[step], "kl_penalty")[row]
            torch.testing.assert_close(got.double(), kl[i], rtol=0, atol=1e-9)


def test_a_dense_batch_of_several_dims_is_refused(models):
    tok, policy, reference = models
    td = chat_batch(CHATS).unsqueeze(0)
    with pytest.raises(ValueError, match=r"batch_size: expected a batch \[B\].*got a dense TensorDict of batch size \[1, 2\].*reshape\(-1\)"):
        RetrieveLogProb(scorer(tok, reference, "history", True, "ref_log_probs"))(td)


# --------------------------------------------------------------------------- ChatEnv, tokens mode
PROMPT_SETS = {
    "gsm8k": [[{"role": "user", "content": "What is 2+3?"}], [{"role": "user", "content": "And 7*6?"}],
              [{"role": "user", "content": "Half of 10?"}]],
    "ifeval": [[{"role": "system", "content": "Answer in lowercase."}, {"role": "user", "content": "Name a fruit."}],
               [{"role": "system", "content": "Use one word."}, {"role": "user", "content": "Sky colour?"}],
               [{"role": "user", "content": "Write 'ok' twice."}]],
}


@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("prompts", list(PROMPT_SETS), ids=list(PROMPT_SETS))
def test_chat_env_kl_with_a_tokens_mode_reference(models, pad_output, prompts):
    """Ports ``test_llm_envs.py::test_chat_env_kl``: a ChatEnv step (three conversations, the
    policy sampling in history mode) goes through ``KLRewardTransform(ref_model)`` whose
    reference reads ``input_mode="tokens"``, with the default ``assistant_only=True``: the
    assistant mask is the batch's (tether used to demand a history-mode reference). The reward
    becomes one entry per token, ``[B, T, 1]`` padded (rows ``[n, 1]`` unpadded); on the sampled
    answer it is ``r - kl`` with ``kl`` = recorded sampling log-prob minus the reference's."""
    tok, policy, reference = models
    actor = TransformersWrapper(policy, tok, generate=True, pad_output=pad_output,
                                generate_kwargs={"max_new_tokens": 4, "generator": torch.Generator().manual_seed(0)})
    td = actor(chat_batch(PROMPT_SETS[prompts], key=("history", "prompt")))
    reward = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
    td["next"] = TensorDict({"reward": reward.reshape(3, 1, 1)}, batch_size=[3])
    out = KLRewardTransform(scorer(tok, reference, "tokens", pad_output, "ref_log_probs"))(td)
    if pad_output:
        assert out["next", "reward"].shape == (3, out["tokens", "full"].shape[-1], 1)
    new_reward, kl_rows = rows(out, ("next", "reward")), rows(out, ("next", "kl_penalty"))
    assistant = rows(out, ("masks", "all_assistant_mask"))
    for b, (ids, sampled) in enumerate(zip(token_rows(out), rows(out, ("log_probs", "full")))):
        mask = assistant[b].bool()
        assert int(mask.sum()) > 0 and new_reward[b].shape == (len(ids), 1)
        with torch.no_grad():
            kl = (sampled.double() - naive_logprobs(reference, ids)) * mask
        torch.testing.assert_close(kl_rows[b].double(), kl, rtol=0, atol=1e-5)
        torch.testing.assert_close(new_reward[b][:, 0].double(), reward[b] - kl, rtol=0, atol=1e-5)


def test_chat_env_kl_tokens_mode_needs_the_batch_mask(models):
    """A tokens-mode reference with assistant_only=True on a batch without an assistant mask
    raises a KeyError naming the mask and the fixes."""
    tok, _, reference = models
    td = batch_for(tok, "tokens")
    td["log_probs", "full"] = torch.zeros(td["tokens", "full"].shape, dtype=torch.float64)
    td["next"] = TensorDict({"reward": torch.zeros(2, 1)}, batch_size=[2])
    with pytest.raises(KeyError, match=r"all_assistant_mask.*assistant_only=True needs an assistant mask.*assistant_only=False"):
        KLRewardTransform(scorer(tok, reference, "tokens", True, "ref_log_probs"))(td)


def test_chat_env_kl_in_torchrl(models):
    """Ports ``test_chat_env_kl`` into a real TorchRL ``ChatEnv`` (skips without TorchRL): a
    tokens-mode reference with the default assistant_only=True steps the env; the per-turn KL
    equals the sum, over the response, of sampling log-probs minus reference log-probs."""
    pytest.importorskip("torchrl")
    from torchrl.envs import TransformedEnv
    from torchrl.envs.llm import ChatEnv
    from torchrl.modules.llm import TransformersWrapper as TorchRLWrapper

    from tether.integrations.torchrl_chat import as_chat_env_transform

    tok, policy, reference = models
    transform = KLRewardTransform(scorer(tok, reference, "tokens", True, "ref_log_probs"), add_to_reward=False)
    env = TransformedEnv(ChatEnv(batch_size=(2,), tokenizer=tok, input_mode="history"), as_chat_env_transform(transform))
    actor = TorchRLWrapper(policy, tokenizer=tok, input_mode="history", generate=True, return_log_probs=True,
                           pad_output=True, generate_kwargs={"max_new_tokens": 5})
    td = actor(env.reset(TensorDict({"query": ["hi", "what is 2+3?"]}, batch_size=[2])))
    out = env.step(td)
    prompt, response = td["tokens", "prompt"], td["tokens", "response"]
    attention, recorded = td["masks", "all_attention_mask"], td["log_probs", "response"]
    for i in range(2):
        ids = torch.cat([prompt[i], response[i]])[attention[i]]
        valid = attention[i, prompt.shape[-1]:]
        n = int(valid.sum())
        with torch.no_grad():
            expected = (recorded[i][valid].double() - naive_logprobs(reference, ids)[-n:]).sum()
        torch.testing.assert_close(out["next", "kl_penalty"][i, 0].double(), expected, rtol=0, atol=1e-4)
