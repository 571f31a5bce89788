"""TorchRL's per-answer layouts through tether's pieces, as a TorchRL loop writes them.

TorchRL's reward parsers write one reward per answer as ``("next", "reward")`` ``[B, 1, 1]``;
its ``MCAdvantage`` normalises them per prompt group and writes the advantage in the same
layout; its ``GRPOLoss`` broadcasts that advantage over each answer's tokens. The batches
here come from a sampling ``TransformersWrapper`` (padded and jagged), so they carry the
per-token assistant mask that an earlier version mistook for the rewards' mask.
"""

from __future__ import annotations

import math

import pytest
import tensordict
import torch
from packaging.version import Version

from tether.llm import chat_batch
from tether.models import TransformersWrapper
from tether.models.tiny import byte_tokenizer, tiny_causal_lm
from tether.objectives import GRPOLoss, MCAdvantage

F64 = torch.float64
EPS = 1e-6  # added to the group spread by grpo
PROMPTS = [[{"role": "user", "content": "1+1?"}]] * 2 + [[{"role": "user", "content": "2+2?"}]] * 2


@pytest.fixture(scope="module")
def parts():
    tok = byte_tokenizer()
    return tok, tiny_causal_lm(tok, seed=0, dtype=F64)


def sampled(parts, pad_output: bool):
    """Four answers (two per prompt) from a float64 sampler, TorchRL's done flags ``[B, 1]``."""
    tok, model = parts
    sampler = TransformersWrapper(model, tok, pad_output=pad_output,
                                  generate_kwargs={"max_new_tokens": 5, "generator": torch.Generator().manual_seed(3)})
    td = sampler(chat_batch(PROMPTS, key=("history", "prompt")))
    # The sampler records float32 log-probs; the loss's float64 scorer's own make every ratio 1.
    with torch.no_grad():
        own = TransformersWrapper(model, tok, input_mode="tokens", generate=False, pad_output=pad_output,
                                  log_probs_key="own")(td.clone())
    td.set(("log_probs", "full"), own["own", "full"])
    td.set(("next", "done"), torch.ones(4, 1, dtype=torch.bool))
    return td


@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "jagged"])
@pytest.mark.parametrize("shape", [(4, 1, 1), (4, 1)], ids=["B11", "B1"])
def test_mc_advantage_reads_one_reward_per_answer(parts, pad_output, shape):
    """Rewards 1, 0 (prompt "1+1?") and 2, 2 (prompt "2+2?"), one per answer. Group one: mean
    1/2, Bessel spread sqrt(((1/2)^2 + (1/2)^2) / 1) = sqrt(1/2), so advantages
    +-(1/2) / (sqrt(1/2) + 1e-6) = +-0.707106; group two is constant, so 0. The advantage keeps
    the reward's layout, whatever per-token assistant mask the batch also holds."""
    if not pad_output and Version(tensordict.__version__) < Version("0.15"):
        pytest.skip("tensordict < 0.15 cannot split jagged entries (MCAdvantage says so, naming the fix)")
    td = sampled(parts, pad_output)
    td.set(("next", "reward"), torch.tensor([1.0, 0.0, 2.0, 2.0], dtype=F64).reshape(shape))
    out = MCAdvantage(2, prompt_key=("text", "prompt")).add(td)
    a = 0.5 / (math.sqrt(0.5) + EPS)
    assert out["advantage"].shape == shape
    torch.testing.assert_close(out["advantage"].reshape(4), torch.tensor([a, -a, 0.0, 0.0], dtype=F64),
                               rtol=0, atol=1e-12)


def scorer(parts) -> TransformersWrapper:
    """The loss's actor: the sampler's float64 model scoring the tokens."""
    tok, model = parts
    return TransformersWrapper(model, tok, input_mode="tokens", generate=False)


def assistant_counts(td) -> torch.Tensor:
    mask = td["masks", "all_assistant_mask"]
    if mask.is_nested:
        return torch.tensor([int(row.sum()) for row in mask.unbind(0)], dtype=F64)
    return mask.sum(-1).to(F64)


@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "jagged"])
@pytest.mark.parametrize("shape", [(4, 1, 1), (4, 1), (4,)], ids=["B11", "B1", "B"])
def test_grpo_loss_broadcasts_one_advantage_per_answer(parts, pad_output, shape):
    """On-policy (sampling log-probs from the loss's own float64 scorer: ratio 1, no clipping) the token-mean objective is -(sum_b A_b n_b) / (sum_b n_b), n_b the assistant
    tokens of answer b: each answer's advantage counts once per token it trained. With
    A = (1, -2, 0.5, 3) that is -(n_0 - 2 n_1 + 0.5 n_2 + 3 n_3) / (n_0 + n_1 + n_2 + n_3).
    The same batch with the advantage spelled per token [B, T] gives the same value."""
    td = sampled(parts, pad_output)
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=F64)
    td.set("advantage", adv.reshape(shape))
    loss = GRPOLoss(scorer(parts), entropy_bonus=False)
    n = assistant_counts(td)
    expected = -(adv * n).sum() / n.sum()
    value = loss(td).loss_objective
    torch.testing.assert_close(value, expected, rtol=0, atol=1e-9)
    if pad_output:  # the per-token spelling of the same advantages
        td.set("advantage", adv[:, None].expand(td["tokens", "full"].shape).clone())
        torch.testing.assert_close(loss(td).loss_objective, value, rtol=0, atol=1e-12)


def test_grpo_loss_refuses_advantages_of_another_batch(parts):
    """Three advantages for four answers match neither layout: the error names both."""
    td = sampled(parts, True).clone()
    td.batch_size = torch.Size([])
    td.set("advantage", torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match=r"one per answer.*B = 4.*\(3,\)"):
        GRPOLoss(scorer(parts), entropy_bonus=False)(td)


def test_same_advantages_as_torchrl_mc_advantage():
    """TorchRL 0.14's own MCAdvantage on the same four one-answer trajectories (rewards
    [4, 1, 1], one added at a time as a buffer writes them): same layout, same values but for
    the spread's guard: TorchRL divides by std = sqrt(1/2), tether by std + 1e-6, a relative
    difference of 1e-6 / sqrt(1/2) = 1.41e-6. Skipped without TorchRL (make torchrl-env)."""
    torchrl_llm = pytest.importorskip("torchrl.objectives.llm")
    from tensordict import TensorDict

    from tether.models.batch_io import write_objects

    def trajectories():
        td = TensorDict({("next", "reward"): torch.tensor([1.0, 0.0, 2.0, 2.0], dtype=F64).reshape(4, 1, 1),
                         ("next", "done"): torch.ones(4, 1, dtype=torch.bool)}, batch_size=[4])
        write_objects(td, "query", ["a", "a", "b", "b"])
        return td

    theirs = torchrl_llm.MCAdvantage(grpo_size=2, prompt_key="query")
    emitted = [out for i in range(4) if (out := theirs._inv_call(trajectories()[i : i + 1])) is not None]
    expected = torch.cat([out["advantage"] for out in emitted])
    ours = MCAdvantage(2, prompt_key="query").add(trajectories())["advantage"]
    assert ours.shape == expected.shape == (4, 1, 1)
    torch.testing.assert_close(ours, expected.to(F64), rtol=1.5e-6, atol=1e-12)


def test_lazy_stack_of_unpadded_answers_gives_the_padded_loss(parts):
    """TorchRL's unpadded layout end to end: the prompts made a lazy stack (``to_lazystack(0)``),
    sampled with ``pad_output=False`` (rows of their own lengths), rewards [4, 1, 1] through
    MCAdvantage, then GRPOLoss with a reference KL term. The same draws made padded give the
    same advantages and the same loss terms: the layout changes nothing."""
    from tether.llm import RetrieveKL
    from tether.models.batch_io import get_entry

    tok, model = parts
    ref = tiny_causal_lm(tok, seed=1, dtype=F64)
    values = {}
    for layout, pad_output in (("padded", True), ("lazy", False)):
        sampler = TransformersWrapper(model, tok, pad_output=pad_output, generate_kwargs={
            "max_new_tokens": 5, "generator": torch.Generator().manual_seed(3)})
        prompts = chat_batch(PROMPTS, key=("history", "prompt"))
        td = sampler(prompts if pad_output else prompts.to_lazystack(0))
        ref_scorer = TransformersWrapper(ref, tok, input_mode="tokens", generate=False, pad_output=pad_output,
                                         log_probs_key="ref_log_probs")
        td = RetrieveKL(None, ref_scorer, add_to_reward=False)(td)
        td.set(("next", "reward"), torch.tensor([1.0, 0.0, 2.0, 2.0], dtype=F64).reshape(4, 1, 1))
        td.set(("next", "done"), torch.ones(4, 1, dtype=torch.bool))
        out = MCAdvantage(2, prompt_key=("text", "prompt")).add(td)
        loss = GRPOLoss(scorer(parts), kl_to_ref_coeff=0.1, entropy_bonus=False)(out)
        values[layout] = (get_entry(out, "advantage").reshape(4), loss.loss_objective, loss.loss_kl_to_ref)
    for padded, lazy in zip(values["padded"], values["lazy"]):
        torch.testing.assert_close(lazy, padded, rtol=0, atol=1e-12)
    a = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(values["lazy"][0], torch.tensor([a, -a, 0.0, 0.0], dtype=F64), rtol=0, atol=1e-12)
