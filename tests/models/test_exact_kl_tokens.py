"""``exact_kl_tokens``: the full-vocabulary KL at every position, or only where asked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tether.models.scoring import exact_kl_tokens
from tests.helpers import make_tiny_model, make_tokenizer


def naive_kl(policy, reference, row: torch.Tensor, temperature: float) -> torch.Tensor:
    """sum_v p log(p / q) from the full float64 logits of one unpadded row; position 0 is 0."""
    logp = F.log_softmax(policy(input_ids=row[None]).logits[0, :-1].double() / temperature, -1)
    logq = F.log_softmax(reference(input_ids=row[None]).logits[0, :-1].double() / temperature, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return torch.cat([kl.new_zeros(1), kl])


@pytest.fixture(scope="module")
def models():
    tok = make_tokenizer()
    return make_tiny_model(tok, dtype=torch.float64, seed=0), make_tiny_model(tok, dtype=torch.float64, seed=1)


def test_matches_naive_kl_and_where_narrows_it(models):
    policy, reference = models
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 250, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    mask[2, 7:] = False  # right padding
    full = exact_kl_tokens(policy, reference, tokens, mask, temperature=0.7)
    for row in range(3):
        want = naive_kl(policy, reference, tokens[row][mask[row]], 0.7)
        torch.testing.assert_close(full[row][mask[row]].double(), want, rtol=0, atol=1e-10)
    where = torch.rand(3, 9, generator=g) < 0.5
    narrowed = exact_kl_tokens(policy, reference, tokens, mask, temperature=0.7, where=where)
    torch.testing.assert_close(narrowed, full * where, rtol=0, atol=1e-12)
    assert bool((narrowed[~where] == 0).all())


def test_where_must_be_a_bool_mask_of_the_tokens_shape(models):
    policy, reference = models
    tokens = torch.zeros(2, 4, dtype=torch.long)
    mask = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"where: expected a bool mask of the tokens' shape \(2, 4\)"):
        exact_kl_tokens(policy, reference, tokens, mask, where=torch.ones(2, 4))
