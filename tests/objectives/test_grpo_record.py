"""``GRPOLoss`` on a ``StepRecord`` and on the same batch as a TensorDict: one core, same terms;
the record's reference hidden states add the exact KL, which equals ``exact_kl_tokens``."""

from __future__ import annotations

import torch

from tests.helpers import make_tiny_model, make_tokenizer
from tests.models.test_shared_prefix import grpo_batch
from tether.models import TransformersWrapper
from tether.models.scoring import exact_kl_tokens, score_tokens
from tether.models.records import StepRecord
from tether.objectives import GRPOLoss


def _setup():
    tok = make_tokenizer()
    policy, reference = make_tiny_model(tok, dtype=torch.float64, seed=0), make_tiny_model(tok, dtype=torch.float64, seed=1)
    tokens, attn = grpo_batch([3, 6], group=3, max_response=4, seed=7)
    answer = attn.clone()
    answer[:, :6] = False
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        sample = score_tokens(policy, tokens, attn).log_probs + 0.1 * torch.randn(attn.shape, generator=g, dtype=torch.float64)
        ref = score_tokens(reference, tokens, attn, where=answer, keep_hidden=True)
    record = StepRecord(tokens, attn, answer, torch.tensor([0, 0, 0, 1, 1, 1]), sample * answer,
                        ref_log_probs=ref.log_probs * answer, ref_hidden=ref.hidden,
                        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)[:, None] * answer)
    loss = GRPOLoss(TransformersWrapper(policy, tok, input_mode="tokens", generate=False), kl_to_ref_coeff=0.1)
    return loss, record, policy, reference


def test_record_and_tensordict_give_the_same_terms_and_gradients():
    """Float64: every term equal to 1e-12 and the same gradient; only the record (which carries
    the reference's hidden states) has the exact KL."""
    loss, record, policy, _ = _setup()
    outs, grads = [], []
    for data in (record, record.to_tensordict()):
        policy.zero_grad()
        terms = loss.token_terms(data)
        loss.reduce(terms).total_loss().backward()
        outs.append(terms.detach())
        grads.append([p.grad.clone() for p in policy.parameters()])
    a, b = outs
    for name in ("policy", "clipped", "ratio_gap", "log_weights", "entropy", "kl_to_ref", "kl_to_ref_term"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=1e-12, msg=name)
    for x, y in zip(*grads):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
    assert a.kl_to_ref_exact is not None and b.kl_to_ref_exact is None


def test_exact_kl_of_the_loss_pass_equals_a_separate_exact_pass():
    loss, record, policy, reference = _setup()
    terms = loss.token_terms(record)
    want = exact_kl_tokens(policy, reference, record.tokens, record.attention_mask, where=record.assistant_mask)
    torch.testing.assert_close(terms.kl_to_ref_exact, want.to(terms.kl_to_ref_exact.dtype), rtol=0, atol=1e-12)
    assert float(loss.reduce(terms).kl_to_ref_exact) > 0
