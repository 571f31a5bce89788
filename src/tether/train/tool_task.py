"""``arithmetic-tools``: multi-digit products that a 135M model gets wrong unless it calls the calculator.

Each problem asks ``a * b`` with ``a`` in [100, 999] and ``b`` in [10, 99] (products of 4 to 5
digits), in one of ``PHRASINGS`` drawn with the problem. The system prompt describes the
``calculator`` tool and the ``<tool_call>`` format (``tether.rollout.tool_calls``), and one
worked episode for a bare ``"What is a * b?"`` precedes the question. Reward: 1.0 when the
last integer of the last assistant message is the product, else 0 (no format bonus: the tool
is only worth calling because it gets the number right). The held-out score is the same check.
An episode holds at most 3 assistant messages and 512 tokens (``--max-turns``,
``--max-episode-tokens`` change them).

Why this mix (measured on SmolLM2-135M-Instruct, 48 tokens a message, 16 problems each): with
the worked example and only its own phrasing, greedy episodes copy it and are right 14 times
in 16, leaving the held-out score nothing to show; without an example the model never calls
the tool and gets no product right (0 of 16, greedy or sampled), which leaves RL no signal. With
the example and the varied phrasings, greedy episodes call the tool on about half the problems
and are right on about a third: the tool is needed, and there is room to learn to use it.
"""

from __future__ import annotations

import random

from tether.train.tasks import Problem, Task, ToolUse, last_integer_correct

SYSTEM_PROMPT = (
    "You are a careful assistant with a calculator. To compute, reply with only a tool call:\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>\n'
    "The result comes back in a tool message. Then reply with the final answer as a number."
)


# One worked episode before the question: a 135M model copies a demonstration far more
# readily than it follows an instruction. It is prompt, never trained on.
EXAMPLE = [
    {"role": "user", "content": "What is 512 * 37?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "512 * 37"}}</tool_call>'},
    {"role": "tool", "content": "18944"},
    {"role": "assistant", "content": "18944"},
]

# Only the first is the example's shape; the others make the model map words to an expression.
PHRASINGS = (
    "What is {a} * {b}?",
    "Multiply {a} by {b}.",
    "What is the product of {a} and {b}?",
    "A box holds {b} rows of {a} beads. How many beads are in the box?",
    "Compute {a} times {b}.",
)


def _product_problem(rng: random.Random) -> Problem:
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    question = rng.choice(PHRASINGS).format(a=a, b=b)
    chat = [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLE, {"role": "user", "content": question}]
    return Problem(chat=chat, answer=str(a * b), key=f"{a}*{b}", columns={"answer": str(a * b)})


def _reward(response: str, problem: Problem) -> float:
    return 1.0 if last_integer_correct(response, problem) else 0.0


def arithmetic_tools() -> Task:
    return Task(
        name="arithmetic-tools",
        make_problem=_product_problem,
        reward=_reward,
        is_correct=last_integer_correct,
        info={"reward": "1 if the last integer of the final answer is the product a * b, else 0",
              "tools": "calculator"},
        tool_use=ToolUse(tools=("calculator",), max_turns=3, max_tokens=512),
    )
