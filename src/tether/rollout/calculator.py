"""``calculator``: exact integer arithmetic on a short expression, parsed with ``ast`` (no ``eval``).

Only integer literals, parentheses, unary ``+``/``-`` and the binary operators
``+ - * // % **`` are accepted; anything else (names, calls, floats, strings, ``/``) is a
``ValueError`` that names what was found, which the tool runner hands back to the model as
an error turn. Bounds keep every evaluation tiny whatever the model writes: at most
``MAX_CHARS`` characters, exponents in ``[0, MAX_EXPONENT]``, and no intermediate value with
more than ``MAX_BITS`` bits (about 300 decimal digits), checked before the operation that
would make it.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable

__all__ = ["MAX_BITS", "MAX_CHARS", "MAX_EXPONENT", "calculator"]

MAX_CHARS = 200
MAX_EXPONENT = 64
MAX_BITS = 1000

_BINARY: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


def _bits_after(op: type, left: int, right: int) -> int:
    """An upper bound on the bit length of ``left op right`` (computed without doing it)."""
    a, b = left.bit_length(), right.bit_length()
    if op is ast.Pow:
        return a * right
    if op is ast.Mult:
        return a + b
    return max(a, b) + 1


def _binary(node: ast.BinOp) -> int:
    op = type(node.op)
    if op not in _BINARY:
        raise ValueError(f"operator {type(node.op).__name__} is not allowed; use + - * // % ** on integers")
    left, right = _value(node.left), _value(node.right)
    if op is ast.Pow and not 0 <= right <= MAX_EXPONENT:
        raise ValueError(f"exponent {right} is outside [0, {MAX_EXPONENT}]")
    if op in (ast.FloorDiv, ast.Mod) and right == 0:
        raise ValueError(f"{_SYMBOL[op]} by zero")
    if _bits_after(op, left, right) > MAX_BITS:
        raise ValueError(f"the result would exceed {MAX_BITS} bits")
    return _BINARY[op](left, right)


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant):
        # bool is an int subclass: True + 1 must not pass as arithmetic.
        if type(node.value) is not int:
            raise ValueError(f"only integer literals are allowed, got {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        return _binary(node)
    raise ValueError(f"{type(node).__name__} is not allowed; write integers with + - * // % ** and parentheses")


def calculator(expression: str) -> str:
    """The exact value of an integer expression such as ``"(12 + 7) * 431 // 2"``, as a string.

    Raises:
        TypeError: ``expression`` is not a string.
        ValueError: the expression is empty, too long, not valid Python syntax, uses anything
            but integer literals and ``+ - * // % **``, divides by zero, or breaks a bound.
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression: expected a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ValueError("expression is empty; pass an integer expression such as '12 * 34'")
    if len(text) > MAX_CHARS:
        raise ValueError(f"expression has {len(text)} characters; at most {MAX_CHARS} are allowed")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"expression {text!r} is not valid syntax ({exc.msg})") from None
    return str(_value(tree.body))
