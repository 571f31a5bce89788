"""Run under ``torch.distributed.run`` by ``test_sharded.py``: the leash's hold on 2 ranks gathers
the weights once, whatever number of readings its line search takes.

``tether train`` runs 3 fully fine-tuned budget steps on the tiny float64 model, with a target
(0.02 nats at lr 1e-2) that makes the budget search its line every step; further ``key=value``
arguments override the run's config. Each hold counts the times ``Ranks.unsharded`` actually
gathered: one when it starts, and one more after a rejection, which restores the shards. Prints
one line per step and rank; exits 1 when a count differs, or when no hold read twice (then the
count could not tell one gather a reading from one a hold).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

from tether.train import recipe, sharding
from tether.train.cli import main as tether

HERE = Path(__file__).parent


def main() -> int:
    gathers, holds = [0], []
    plain = sharding.Ranks.unsharded

    @contextmanager
    def counted(self):
        gathers[0] += not self.gathered
        with plain(self):
            yield

    sharding.Ranks.unsharded = counted
    hold = recipe.hold_kl_budget

    def counted_hold(run, record, **kw):
        before = gathers[0]
        move = hold(run, record, **kw)
        holds.append((gathers[0] - before, move))
        return move

    recipe.hold_kl_budget = counted_hold
    flags = dict(model="tiny", task=str(HERE / "count_task.py"), steps=3, out=sys.argv[1], prompts_per_step=4,
                 group_size=2, max_new_tokens=16, micro_batch_size=3, eval_size=2, eval_max_new_tokens=4, lora_rank=0,
                 learning_rate=1e-2, checkpoint_every=0, threads=1, dtype="float64", kl_controller="budget",
                 kl_target=0.02, **dict(word.split("=", 1) for word in sys.argv[2:]))
    code = tether(["train", "--quiet", *[f"{k}={v}" for k, v in flags.items()]])
    ok = code == 0 and len(holds) == 3 and any(move.forwards >= 2 for _, move in holds)
    for step, (count, move) in enumerate(holds, 1):
        right = count == 1 + move.rejected
        ok = ok and right
        print(f"step {step}: gathers {count}, readings {move.forwards}, rejected {move.rejected}"
              f"{'' if right else ' WRONG'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
