"""A controller drives the coefficient GRPOLoss actually uses."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tether.control import AdaptiveKLController
from tether.models import TransformersWrapper
from tether.objectives import GRPOLoss
from tests.helpers import make_tiny_model, make_tokenizer


def test_adaptive_controller_changes_the_loss_kl_term():
    """beta 0.1, target 1, horizon 10, KL 3 over 2 sequences: e = clip(2, -.2, .2) = .2,
    beta <- 0.1 * (1 + 0.2 * 2 / 10) = 0.104; loss_kl_to_ref scales by exactly 1.04."""
    tok = make_tokenizer()
    model = make_tiny_model(tok, dtype=torch.float64)
    actor = TransformersWrapper(model, tok, input_mode="tokens", generate=False)
    loss = GRPOLoss(actor, kl_to_ref_coeff=0.1, entropy_bonus=False)
    tokens = torch.randint(0, 256, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    resp = mask.clone()
    resp[:, :3] = False
    with torch.no_grad():
        cur = actor.score(tokens, mask).log_probs
    td = TensorDict({("tokens", "full"): tokens, ("masks", "all_attention_mask"): mask,
                     ("masks", "all_assistant_mask"): resp, ("log_probs", "full"): cur * resp,
                     ("ref_log_probs", "full"): (cur - 0.3) * resp, "advantage": torch.ones(2, 1)}, batch_size=[2])
    before = loss(td).loss_kl_to_ref.detach()
    controller = AdaptiveKLController(init_kl_coef=0.1, target=1.0, horizon=10, model=loss)
    new = controller.update([3.0, 3.0])
    assert abs(new - 0.104) < 1e-12 and loss.kl_coef == new
    after = loss(td).loss_kl_to_ref.detach()
    torch.testing.assert_close(after, before * 1.04, rtol=1e-12, atol=0)
