"""The argument parser of the ``tether`` command: one-line errors and TRL flag names.

argparse reports a bad command line with the usage block and exits with status 2; ``Parser``
keeps the status but prints one line, and an unknown ``--flag`` gets the closest known flag
as a suggestion. ``add_trl_flags`` accepts TRL's ``GRPOConfig`` names as hidden flags
(``--beta 0.04``, ``--num_generations 8``, a bare ``--bf16``) and ``trl_flag_values`` hands
them to the config as keys, where ``tether.train.config.TRL_NAMES`` maps or explains each one.
"""

from __future__ import annotations

import argparse
import difflib
import re
from typing import NoReturn

from tether.train.config import TRL_NAMES

_DEST = "trl:"


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (status 2, as argparse's)."""

    def add_argument(self, *names: str, **kwargs) -> argparse.Action:
        # Recorded for suggestions (argparse's own __init__ adds --help before any of ours).
        self.__dict__.setdefault("long_flags", []).extend(n for n in names if n.startswith("--"))
        return super().add_argument(*names, **kwargs)

    def error(self, message: str) -> NoReturn:
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            message += self._suggestion(unknown.group(1).split())
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def _suggestion(self, words: list[str]) -> str:
        for word in words:
            if word.startswith("--"):
                close = difflib.get_close_matches(word.split("=")[0], self.long_flags, n=1, cutoff=0.6)
                if close:
                    return f"; did you mean {close[0]}?"
        return ""


def add_trl_flags(parser: argparse.ArgumentParser, fields: set[str]) -> None:
    """Hidden ``--name`` / ``--name-with-dashes`` flags for the TRL names that are not tether keys."""
    for name, entry in TRL_NAMES.items():
        if name in fields:
            continue
        spellings = dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"])
        extra = {"nargs": "?", "const": "true"} if entry.switch else {}
        parser.add_argument(*spellings, dest=_DEST + name, default=None, help=argparse.SUPPRESS, **extra)


def trl_flag_values(args: argparse.Namespace) -> dict[str, str]:
    """The TRL-named flags given on the command line, as ``{trl_name: value}``."""
    return {dest[len(_DEST):]: value for dest, value in vars(args).items()
            if dest.startswith(_DEST) and value is not None}


__all__ = ["Parser", "add_trl_flags", "trl_flag_values"]
