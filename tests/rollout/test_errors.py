"""Every error path of RolloutFromModel and its helpers raises a typed, named error."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tests.helpers import make_tiny_model, make_tokenizer
from tests.rollout.builders import prompt_batch, reward_model
from tether.rollout import RolloutFromModel, resolve_eos_ids, resolve_pad_id, stepwise_views

BATCH = dict(prompts=[[257, 1, 2], [257, 3]], completions=[[4], [5, 6]])


@pytest.fixture
def parts():
    tok = make_tokenizer()
    model = make_tiny_model(tok)
    return tok, model, reward_model(dtype=torch.float32)


def model_without_special_ids(tok):
    model = make_tiny_model(tok)
    for config in (model.config, model.generation_config):
        config.eos_token_id = None
        config.pad_token_id = None
    return model


def test_special_ids_come_from_the_tokenizer_then_the_config(parts):
    tok, model, rm = parts
    assert resolve_eos_ids(None, model, tok) == (258,) and resolve_pad_id(None, model, tok) == 259
    bare = model_without_special_ids(tok)
    bare.config.eos_token_id = [258, 256]
    assert resolve_eos_ids(None, bare, None) == (256, 258)
    assert resolve_eos_ids(7, bare, tok) == (7,) and resolve_pad_id(9, bare, tok) == 9
    rollout = RolloutFromModel(model, model, rm, tokenizer=make_tokenizer(pad_is_eos=True))
    assert rollout.eos_token_ids == (258,) and rollout.pad_token_id == 258


def test_missing_eos_and_pad_are_errors(parts):
    tok, _, rm = parts
    bare = model_without_special_ids(tok)
    with pytest.raises(ValueError, match="eos_token_id: none given and none found"):
        RolloutFromModel(bare, bare, rm)
    with pytest.raises(ValueError, match="pad_token_id: none given and none found"):
        RolloutFromModel(bare, bare, rm, eos_token_id=258)
    with pytest.raises(TypeError, match="eos_token_id: expected an int >= 0"):
        RolloutFromModel(bare, bare, rm, eos_token_id="</s>", pad_token_id=0)
    with pytest.raises(TypeError, match="pad_token_id: expected an int >= 0"):
        RolloutFromModel(bare, bare, rm, eos_token_id=258, pad_token_id=[1, 2])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens: expected an int >= 1"),
        ({"score_clip": 0.0}, ValueError, "score_clip: expected a number > 0, got 0.0"),
        ({"temperature": 0.0}, ValueError, "temperature: expected a finite number > 0, got 0.0"),
        ({"temperature": float("inf")}, ValueError, "temperature: expected a finite number"),
        ({"num_steps": 0}, ValueError, "num_steps: expected an int >= 1"),
        ({"kl_coef": -0.1}, ValueError, "kl_coef: expected a finite number >= 0, got -0.1"),
        ({"kl_coef": "0.1"}, TypeError, "kl_coef: expected a finite number >= 0, got '0.1' of type str"),
        ({"kl_scheduler": object()}, TypeError, "kl_scheduler: expected a KL controller"),
    ],
)
def test_constructor_arguments_are_validated(parts, kwargs, error, match):
    tok, model, rm = parts
    with pytest.raises(error, match=match):
        RolloutFromModel(model, model, rm, tokenizer=tok, **kwargs)


def test_models_must_be_modules_and_reward_model_callable(parts):
    tok, model, rm = parts
    with pytest.raises(TypeError, match="ref_model: expected a Hugging Face causal LM"):
        RolloutFromModel(model, "gpt2", rm, tokenizer=tok)
    with pytest.raises(TypeError, match="reward_model: expected a callable"):
        RolloutFromModel(model, model, 3.0, tokenizer=tok)


def test_kl_coef_setter_validates(parts):
    tok, model, rm = parts
    rollout = RolloutFromModel(model, model, rm, tokenizer=tok)
    rollout.kl_coef = 0.25
    assert rollout.kl_coef == 0.25
    with pytest.raises(ValueError, match="kl_coef: expected a finite number"):
        rollout.kl_coef = float("nan")


def test_batch_must_be_a_prompt_batch(parts):
    tok, model, rm = parts
    rollout = RolloutFromModel(model, model, rm, tokenizer=tok, max_new_tokens=2)
    with pytest.raises(TypeError, match="batch: expected a tether.rollout.PromptBatch"):
        rollout.generate({"input_ids": torch.ones(1, 2, dtype=torch.long)})


def test_create_rollout_td_checks_its_inputs(parts):
    tok, model, rm = parts
    rollout = RolloutFromModel(model, model, rm, tokenizer=tok, max_new_tokens=2)
    batch = prompt_batch(**BATCH, pad=259)
    good = torch.full((2, batch.input_ids.shape[1] + 2), 7)
    zeros = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"generated: expected shape \[B, L \+ max_new_tokens\]"):
        rollout.create_rollout_td(batch, good[:, :-1], zeros, zeros)
    with pytest.raises(TypeError, match="generated: expected an integer tensor"):
        rollout.create_rollout_td(batch, good.float(), zeros, zeros)
    with pytest.raises(ValueError, match=r"log_probs: expected shape \[B, N\]"):
        rollout.create_rollout_td(batch, good, torch.zeros(2, 3), zeros)
    with pytest.raises(TypeError, match="log_ratio: expected a float tensor"):
        rollout.create_rollout_td(batch, good, zeros, zeros.long())


def test_reward_model_output_must_carry_end_scores(parts):
    tok, model, _ = parts

    def bad_reward_model(input_ids, attention_mask):
        return torch.zeros(input_ids.shape[0], 3)

    rollout = RolloutFromModel(model, model, bad_reward_model, tokenizer=tok, max_new_tokens=2)
    batch = prompt_batch(**BATCH, pad=259)
    good = torch.full((2, batch.input_ids.shape[1] + 2), 7)
    with pytest.raises(TypeError, match="reward_model: expected an output with end_scores"):
        rollout.create_rollout_td(batch, good, torch.zeros(2, 2), torch.zeros(2, 2))


def test_reward_model_may_return_the_seed_pair(parts):
    """A (token_scores, end_scores) pair works: end 2.0 against reference 0.5 gives 1.5."""
    tok, model, _ = parts

    def pair_reward_model(input_ids, attention_mask):
        ends = attention_mask.sum(-1).float()
        return torch.zeros(input_ids.shape), torch.where(ends > 3, 2.0, 0.5)

    rollout = RolloutFromModel(model, model, pair_reward_model, tokenizer=tok, max_new_tokens=2)
    batch = prompt_batch([[257, 1]], [[5]], pad=259)
    generated = torch.tensor([[257, 1, 7, 8, 259]])
    td = rollout.create_rollout_td(batch, generated, torch.zeros(1, 2), torch.zeros(1, 2))
    assert td["next", "reward_raw"][0, :, 0].tolist() == [0.0, 1.5]


def test_stepwise_views_needs_a_rollout_and_mask_label_an_int_pad():
    with pytest.raises(KeyError, match="'sequence', 'length'"):
        stepwise_views(TensorDict({"action": torch.zeros(2, 3)}, batch_size=[2, 3]), 0)
    batch = prompt_batch(**BATCH, pad=259)
    with pytest.raises(TypeError, match="pad_token_id: expected an int"):
        batch.mask_label(None)


def test_wrapper_resolves_special_ids_by_the_same_policy(parts):
    """TransformersWrapper and RolloutFromModel share one policy: explicit ids win, then the
    tokenizer, then the configs; a model with no pad id anywhere is an error naming the wrapper
    and the keyword (an earlier wrapper silently padded with the smallest eos id)."""
    from tether.models import TransformersWrapper

    tok, model, _ = parts
    wrapper = TransformersWrapper(model, tok, generate=False)
    assert wrapper.eos_ids == {258} and wrapper.pad_id == 259
    bare = model_without_special_ids(tok)
    bare.config.eos_token_id = 258
    with pytest.raises(ValueError, match=r"pad_token_id: none given.*Pass pad_token_id=<id> to TransformersWrapper"):
        TransformersWrapper(bare, input_mode="tokens", generate=False)
    explicit = TransformersWrapper(bare, input_mode="tokens", generate=False, pad_token_id=258, eos_token_id=[256, 258])
    assert explicit.eos_ids == {256, 258} and explicit.pad_id == 258
