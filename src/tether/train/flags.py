"""The command line of ``tether train`` (and of a copied recipe) read into a ``TrainConfig``.

Flags are generated from ``TrainConfig``'s fields (``--prompts-per-step 8`` sets
``prompts_per_step``), and their help is the field documentation. ``--config FILE`` loads a
YAML file first; trailing ``key=value`` words override both. ``--resume RUN`` takes RUN's
config.yaml, and its flags and overrides may change only what a resume may change. TRL
``GRPOConfig`` names are accepted as flags and keys (``tether.integrations.trl.TRL_NAMES``). A
bad command line is one line on stderr, with the closest known flag as a suggestion (``Parser``).
"""

from __future__ import annotations

import argparse
import difflib
import re
from dataclasses import fields
from pathlib import Path
from typing import NoReturn

from tether.integrations.trl import TRL_NAMES
from tether.train.config import LIST_FIELDS, TrainConfig, config_choices
from tether.train.run_dir import check_resume_overrides, read_run_config


# ------------------------------------------------------------------------------ the parser
# argparse reports a bad command line with the usage block; ``Parser`` keeps its status 2 but prints
# one line. ``add_trl_flags`` accepts TRL's ``GRPOConfig`` names as hidden flags (``--beta 0.04``,
# ``--num_generations 8``, a bare ``--bf16``) and ``trl_flag_values`` hands them to the config as keys.
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


# ------------------------------------------------------------------------------ tether train's flags
class ChoicesHelp(argparse.HelpFormatter):
    """``--help`` shows a choice field's names (``--dtype {float32,bfloat16,...}``), read from its
    registry only when help is printed: the registries import the models, which every other
    command would otherwise pay for."""

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        table = config_choices().get(action.dest) if hasattr(action, "field_type") else None
        if table is not None:
            return "{" + ",".join(table) + "}"
        return getattr(action, "field_type", None) or super()._get_default_metavar_for_optional(action)


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """``tether train``'s flags on ``p`` (give it ``formatter_class=ChoicesHelp``)."""
    # Flags default to None (meaning "not given", so --config and overrides can apply); the real
    # default is the config field's, written into each help line by hand.
    p.add_argument("--config", help="YAML file of config keys, applied before flags and key=value overrides.")
    p.add_argument("--resume", metavar="RUN_DIR", help="Continue RUN_DIR from its newest intact checkpoint with "
                   "its config.yaml; flags may change only steps, the checkpoint cadence and threads. A finished "
                   "run (its newest checkpoint at steps, summary.json written) is left as it is, with one line "
                   "saying so: extend it with --steps N, score it with tether eval RUN_DIR. A run stopped during "
                   "its final evaluation (no summary.json) runs that evaluation again; one stopped before its first "
                   "checkpoint starts again from step 0 with its config.yaml. Either way the run directory is "
                   "checked first: an edited config.yaml or a damaged log is named.")
    p.add_argument("--quiet", action="store_true", help="No progress bar.")
    for f in fields(TrainConfig):
        flag, text = f"--{f.name.replace('_', '-')}", f"{f.metadata['help']} (default: {f.default})"
        # TRL's spelling (--learning_rate) as a hidden alias of --learning-rate.
        for spelling, shown in ((flag, text), (f"--{f.name}", argparse.SUPPRESS))[: 1 + ("_" in f.name)]:
            if isinstance(f.default, bool):  # a switch: --overwrite, not --overwrite true; --no-kl-push turns one off
                p.add_argument(spelling, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=shown)
            else:
                several = {"action": "append"} if f.name in LIST_FIELDS else {}
                action = p.add_argument(spelling, dest=f.name, default=None, help=shown, **several)
                action.field_type = type(f.default).__name__.upper()  # the metavar, unless a choice field's names
    p.add_argument("overrides", nargs="*", metavar="key=value", help="Config overrides.")
    add_trl_flags(p, set(TrainConfig.field_names()))


def parse_overrides(words: list[str]) -> dict[str, str]:
    """``key=value`` words as config changes (``-`` in a key read as ``_``); a word without ``=`` is refused."""
    out: dict[str, str] = {}
    for word in words:
        if "=" not in word:
            raise ValueError(f"expected key=value overrides, got {word!r}.")
        key, value = word.split("=", 1)
        out[key.strip().replace("-", "_")] = value
    return out


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's config: ``--config`` or ``--resume``'s config.yaml, then the flags and ``key=value`` words."""
    flags = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name) is not None}
    flags.update({name: ",".join(flags[name]) for name in LIST_FIELDS if name in flags})
    changes = {**trl_flag_values(args), **flags, **parse_overrides(args.overrides)}
    if args.resume:
        if args.config:
            raise ValueError(f"--config and --resume {args.resume} together: a resume uses the run's own config.yaml.")
        if "out" in changes and Path(changes["out"]) != Path(args.resume):
            raise ValueError(f"--out {changes['out']} and --resume {args.resume}: a resume writes into the run it continues.")
        stored = read_run_config(Path(args.resume))
        cfg = stored.override(changes)
        check_resume_overrides(stored, cfg)
        return cfg
    cfg = TrainConfig.from_yaml(args.config) if args.config else TrainConfig()
    return cfg.override(changes)
