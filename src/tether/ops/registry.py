"""Look-ups in tether's small registries of variants, with one error format for every unknown name.

Every variant family (KL estimators, aggregation modes, advantage modes, importance-weight
modes, padding sides, ratio levels, KL controllers, config choices) is a plain ``dict`` from
name to implementation. ``lookup`` is the only way code reads one by a user-given name, so a
typo anywhere gets the same message, in the words of ``tether.ops.checks``: the argument, the
names to choose from, and what came.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import TypeVar

__all__ = ["choice_error", "lookup"]

T = TypeVar("T")


def choice_error(argument: str, value: object, choices: Iterable[Hashable]) -> ValueError:
    """The ``ValueError`` for ``argument=value`` not being one of ``choices``."""
    supported = ", ".join(repr(name) for name in choices)
    return ValueError(f"{argument}: expected one of {supported}, got {value!r}.")


def lookup(table: Mapping[str, T], name: object, argument: str) -> T:
    """``table[name]``, or a ``ValueError`` naming ``argument`` and listing the table's names."""
    if not isinstance(name, Hashable) or name not in table:
        raise choice_error(argument, name, table)
    return table[name]
