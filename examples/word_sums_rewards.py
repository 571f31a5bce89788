"""Reward functions for examples/word_sums.jsonl, in TRL's GRPOTrainer convention.

Each function gets the batch's prompts and completions (chat format: a completion is
``[{"role": "assistant", "content": text}]``) and every other dataset column by keyword
(here ``answer``), and returns one float, or None where it does not apply, per completion.
``tether train --reward-funcs`` uses every public function of this file, in order; weigh
them with ``--reward-weights`` (format first, then correctness).
"""

import re

_INTEGER = re.compile(r"-?\d+")
_ENDS_IN_NUMBER = re.compile(r"[^\n]{0,40}?-?\d+\.?\s*")


def _text(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion


def format_reward(prompts, completions, **kwargs):
    """1.0 when the reply is one short line (at most about 40 characters) ending in a number, else 0.0."""
    return [1.0 if _ENDS_IN_NUMBER.fullmatch(_text(c).strip()) else 0.0 for c in completions]


def correctness_reward(prompts, completions, answer, **kwargs):
    """1.0 when the reply's last integer is the answer, 0.0 otherwise; None for rows without an answer."""
    rewards = []
    for completion, expected in zip(completions, answer):
        if expected is None:
            rewards.append(None)
            continue
        found = _INTEGER.findall(_text(completion).replace(",", ""))
        rewards.append(1.0 if found and found[-1] == str(expected) else 0.0)
    return rewards
