"""tether's LLM ``RetrieveKL`` and ``KLRewardTransform`` as transforms of a TorchRL
``TransformedEnv`` over ``ChatEnv`` (skipped where TorchRL is not installed, as in ``.venv``).

Two turns of a two-conversation batch are stepped with TorchRL's own ``TransformersWrapper``
as the policy; each step's KL must equal the sum, over that turn's assistant tokens only, of
log-prob differences computed naively (full forward passes) from the step's data.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_tiny_model, make_tokenizer
from tests.llm.naive import naive_logprobs
from tether.llm import KLRewardTransform, RetrieveKL
from tether.models import TransformersWrapper, tokenize_chats
from tether.models.chat import render_chat_ids

torchrl = pytest.importorskip("torchrl")


def setup(transform_factory):
    from tensordict import TensorDict
    from torchrl.envs import TransformedEnv
    from torchrl.envs.llm import ChatEnv
    from torchrl.modules.llm import TransformersWrapper as TorchRLWrapper

    from tether.integrations.torchrl_chat import as_chat_env_transform

    tok = make_tokenizer()
    policy, reference = make_tiny_model(tok, seed=0), make_tiny_model(tok, seed=1)
    scorer = lambda m, key: TransformersWrapper(m, tok, generate=False, log_probs_key=key)  # noqa: E731
    env = TransformedEnv(ChatEnv(batch_size=(2,), tokenizer=tok, input_mode="history"),
                         as_chat_env_transform(transform_factory(scorer, policy, reference)))
    actor = TorchRLWrapper(policy, tokenizer=tok, input_mode="history", generate=True, return_log_probs=True,
                           pad_output=True, generate_kwargs={"max_new_tokens": 5})
    first = env.reset(TensorDict({"query": ["hi", "what is 2+3?"]}, batch_size=[2]))
    return tok, policy, reference, env, actor, first


def chats(history):
    from tether.integrations.torchrl_chat import history_to_chats

    return history_to_chats(history)


def test_retrieve_kl_scores_the_newest_turn_from_the_history():
    tok, policy, reference, env, actor, td = setup(
        lambda scorer, p, r: RetrieveKL(scorer(p, "log_probs"), scorer(r, "ref_log_probs"), add_to_reward=False))
    for _ in range(2):
        # Without TorchRL's token entries the ids come from the rendered history.
        td = actor(td).exclude("tokens", "masks", "log_probs")
        out = env.step(td)
        full, prompt = chats(td["history"].full), chats(td["history"].prompt)
        enc = tokenize_chats(tok, full)
        for i in range(2):
            ids = enc.input_ids[i]
            start = len(render_chat_ids(tok, prompt[i], add_generation_prompt=True))
            newest = enc.assistant_mask[i] & (torch.arange(len(ids)) >= start)
            # On the 2nd turn the prompt holds the 1st assistant turn: masked, but not charged again.
            earlier = any(m["role"] == "assistant" for m in prompt[i])
            assert int(newest.sum()) > 0 and bool(enc.assistant_mask[i][:start].any()) == earlier
            with torch.no_grad():
                expected = ((naive_logprobs(policy, ids) - naive_logprobs(reference, ids)) * newest).sum()
            torch.testing.assert_close(out["next", "kl_penalty"][i, 0].double(), expected, rtol=0, atol=1e-4)
        td = out["next"].exclude("kl_penalty")


@pytest.mark.parametrize("kind", ["KLRewardTransform", "RetrieveKL"])
def test_policy_tokens_are_scored_as_sampled(kind):
    """KLRewardTransform reuses TorchRL's recorded response log-probs; RetrieveKL re-scores the
    same ids with the policy. Both sum over the response tokens of this turn only."""
    def factory(scorer, p, r):
        if kind == "RetrieveKL":
            return RetrieveKL(scorer(p, "log_probs"), scorer(r, "ref_log_probs"), add_to_reward=False)
        return KLRewardTransform(scorer(r, "ref_log_probs"), coef=0.5, add_to_reward=False)

    tok, policy, reference, env, actor, td = setup(factory)
    td = actor(td)
    out = env.step(td)
    prompt, response = td["tokens", "prompt"], td["tokens", "response"]
    attention = td["masks", "all_attention_mask"]
    recorded = td["log_probs", "response"]
    width = prompt.shape[-1]
    for i in range(2):
        ids = torch.cat([prompt[i], response[i]])[attention[i]]
        resp_valid = attention[i, width:]
        n = int(resp_valid.sum())
        with torch.no_grad():
            ref = naive_logprobs(reference, ids)[-n:]
            mine = naive_logprobs(policy, ids)[-n:]
        gen = recorded[i][resp_valid].double() if kind == "KLRewardTransform" else mine
        expected = (gen - ref).sum()
        torch.testing.assert_close(out["next", "kl_penalty"][i, 0].double(), expected, rtol=0, atol=1e-4)


def test_errors():
    from tether.integrations.torchrl_chat import as_chat_env_transform

    with pytest.raises(TypeError, match="expected a tether.llm.KLRewardTransform or tether.llm.RetrieveKL"):
        as_chat_env_transform(torch.nn.Identity())
    _, _, _, env, actor, td = setup(
        lambda scorer, p, r: RetrieveKL(scorer(p, "log_probs"), scorer(r, "ref_log_probs"), add_to_reward=True))
    with pytest.raises(KeyError, match="the step has none. Append a reward transform"):
        env.step(actor(td))
