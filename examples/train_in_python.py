"""The word-sums job of docs/data.md written as a TRL ``GRPOTrainer`` user writes it: an in-memory
``datasets.Dataset``, reward callables and ``tether.train.train``.

    python examples/train_in_python.py                       # the embedded model, 16 steps
    python examples/train_in_python.py model=tiny steps=2    # any TrainConfig field as key=value
"""

import json
import sys
from pathlib import Path

import datasets

from tether.train import train

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from word_sums_rewards import correctness_reward, format_reward  # noqa: E402 (the example's own module)

rows = [json.loads(line) for line in (HERE / "word_sums.jsonl").read_text().splitlines()]
config = {"eval_split": 0.25, "steps": 16, "prompts_per_step": 8, "out": "runs/word_sums_py"}
config.update(arg.split("=", 1) for arg in sys.argv[1:])
summary = train(config, dataset=datasets.Dataset.from_list(rows), reward_funcs=[format_reward, correctness_reward],
                reward_weights=[0.2, 1.0])
print(f"correctness on the held-out rows: {summary['reward/correctness_reward_before']:.2f} -> "
      f"{summary['reward/correctness_reward_after']:.2f}")
