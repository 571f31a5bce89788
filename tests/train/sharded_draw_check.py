"""Run under ``torch.distributed.run`` by ``test_sharded.py``: the shared draw and a float32
FSDP backward on 2 ranks.

Rank 0's rows may sample 1 token and rank 1's up to 12, so rank 0 has no live row for 11
decode steps while rank 1 still samples; it must keep taking part (no deadlock), and the
tokens and log-probs of every rank's rows must be the ones a single process samples for the
whole batch from the same seed. Then a float32 model sharded as the trainer shards it takes
one backward of a loss summed over each rank's rows: the summed gradients must equal one
process's (float32 rounding; the float64 parity runs cannot see a float32-only collective
path). Exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from types import SimpleNamespace

from tether.models.sampling import sample_responses
from tether.models.scoring import score_tokens
from tether.models.tiny import byte_tokenizer, tiny_causal_lm
from tether.train.sharding import Ranks, SharedDraw, shard_models


def float32_gradients_match(ranks: Ranks, tok) -> bool:
    ids = torch.randint(0, 250, (4, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids, dtype=torch.bool)
    whole = tiny_causal_lm(tok, hidden=32, layers=2, seed=0).requires_grad_(True)
    score_tokens(whole, ids, mask).log_probs.sum().backward()
    model = tiny_causal_lm(tok, hidden=32, layers=2, seed=0).requires_grad_(True)
    shard_models(SimpleNamespace(policy=model, reference=tiny_causal_lm(tok, hidden=32, layers=2)), ranks)
    mine = slice(2 * ranks.rank, 2 * ranks.rank + 2)
    score_tokens(model, ids[mine], mask[mine], token_budget=10**9, share_prefix=False).log_probs.sum().backward()
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return all(torch.allclose(got[n], p.grad, rtol=1e-4, atol=1e-5) for n, p in whole.named_parameters())


def main() -> int:
    dist.init_process_group("gloo")
    ranks = Ranks(size=dist.get_world_size(), rank=dist.get_rank())
    tok = byte_tokenizer()
    model = tiny_causal_lm(tok, hidden=32, layers=2, seed=0, dtype=torch.float64)
    prompts = torch.randint(0, 250, (4, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompts, dtype=torch.bool)
    limits = torch.tensor([1, 1, 12, 7])
    common = dict(max_new_tokens=12, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    whole = sample_responses(model, prompts, mask, row_limits=limits, **common,
                             generator=torch.Generator().manual_seed(5))
    mine = slice(2 * ranks.rank, 2 * ranks.rank + 2)
    part = sample_responses(model, prompts[mine], mask[mine], row_limits=limits[mine], **common,
                            generator=torch.Generator().manual_seed(5), draw=SharedDraw(ranks))
    width = part.tokens.shape[1]
    ok = (torch.equal(part.tokens, whole.tokens[mine, :width]) and torch.equal(part.mask, whole.mask[mine, :width])
          and torch.equal(part.log_probs, whole.log_probs[mine, :width]) and not whole.mask[mine, width:].any())
    print(f"rank {ranks.rank}: {'same' if ok else 'DIFFERENT'} tokens {part.tokens.tolist()}", flush=True)
    ranks.device = torch.device("cpu")
    summed = float32_gradients_match(ranks, tok)
    print(f"rank {ranks.rank}: float32 gradients {'summed' if summed else 'DIFFERENT'}", flush=True)
    ok = ok and summed
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
