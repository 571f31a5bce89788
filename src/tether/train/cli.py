"""The ``tether`` command line: ``train``, ``eval``, ``export``, ``plot`` and ``cp``.

``tether train`` flags are generated from ``TrainConfig``'s fields (``--prompts-per-step 8``
sets ``prompts_per_step``), and their help is the field documentation. ``--config FILE``
loads a YAML file first; trailing ``key=value`` words override both. ``--resume RUN`` takes
RUN's config.yaml, and its flags and overrides may change only what a resume may change.
TRL ``GRPOConfig`` names are accepted as flags and keys (``tether.integrations.trl.TRL_NAMES``).

A user error (bad command line, bad config, a directory holding another run, a damaged
checkpoint, a failing task) prints one line on stderr and exits with status 2, without a
traceback unless a dependency raised it (``_fail``); an unknown ``--flag`` gets the closest
known one as a suggestion (``Parser``).
Ctrl-C during ``train`` loses nothing (checkpoints are written atomically) and prints one line
naming the newest intact checkpoint and the command that resumes from it, exiting with 130.
``--nproc N`` runs the command again in N processes under ``torch.distributed.run``
(``launch``) and returns its exit status.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import difflib
import functools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from types import ModuleType
from typing import Callable, NoReturn

from tether.integrations.trl import TRL_NAMES
from tether.train.config import LIST_FIELDS, TrainConfig
from tether.train.tasks import TASKS, TaskError

# The recipes ``tether cp`` copies: name -> module of tether.train.
RECIPES = {"recipe": "recipe", "recipe_ray": "recipe_ray"}

# Exceptions that report a problem with the user's input, files or task, not a bug in tether.
_USER_ERRORS = (ValueError, KeyError, TaskError, OSError)
SUBCOMMANDS = ("train", "eval", "export", "plot", "cp")


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


# ------------------------------------------------------------------------------ the subcommands
class _ChoicesHelp(argparse.HelpFormatter):
    """``--help`` shows a choice field's names (``--dtype {float32,bfloat16,...}``), read from its
    registry only when help is printed: the registries import the models, which every other
    command would otherwise pay for."""

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        from tether.train.config import config_choices

        table = config_choices().get(action.dest) if hasattr(action, "field_type") else None
        if table is not None:
            return "{" + ",".join(table) + "}"
        return getattr(action, "field_type", None) or super()._get_default_metavar_for_optional(action)


def _train_parser(sub) -> None:
    # Flags default to None (meaning "not given", so --config and overrides can apply); the real
    # default is the config field's, written into each help line by hand.
    p = sub.add_parser("train", help="GRPO with a KL leash on the embedded model (defaults) or --model.",
                       formatter_class=_ChoicesHelp)
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


def _parse_overrides(words: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for word in words:
        if "=" not in word:
            raise ValueError(f"expected key=value overrides, got {word!r}.")
        key, value = word.split("=", 1)
        out[key.strip().replace("-", "_")] = value
    return out


def _config(args: argparse.Namespace) -> TrainConfig:
    from tether.train.run_dir import check_resume_overrides, read_run_config

    flags = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name) is not None}
    flags.update({name: ",".join(flags[name]) for name in LIST_FIELDS if name in flags})
    changes = {**trl_flag_values(args), **flags, **_parse_overrides(args.overrides)}
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


def _fail(command: str, exc: BaseException) -> int:
    """Report a user error as one line on stderr; exit status 2. An error of these types that a
    dependency raised, not one of tether's checks, may be a bug tether did not guard against: its
    traceback follows the line (as it does for every error with ``TETHER_TRACEBACK=1``)."""
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    print(f"tether {command}: " + " ".join(line.strip() for line in str(text).splitlines()), file=sys.stderr)
    origin = _raised_in(exc)
    if origin is not None or os.environ.get("TETHER_TRACEBACK"):
        if origin is not None:
            print(f"tether {command}: the {type(exc).__name__} above was raised in {origin}, not by a check of "
                  "tether's; if the line does not say what to change, report it with this traceback:", file=sys.stderr)
        traceback.print_exception(exc, file=sys.stderr)
    return 2


def _raised_in(exc: BaseException) -> str | None:
    """The file of a dependency where ``exc`` was raised, or None when tether raised it. The
    standard library counts as its caller: an ``OSError`` of ``open`` or ``Path.read_text`` on a
    user's path is reported by the tether code that opened it."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        where = Path(frame.filename).resolve()
        library = {"site-packages", "dist-packages"} & set(where.parts)
        if frame.filename.startswith("<") or (where.is_relative_to(stdlib) and not library):
            continue
        return None if where.is_relative_to(Path(__file__).resolve().parents[1]) else str(where)
    return None


def _print_summary(summary: dict) -> None:
    print("\n== tether train: summary ==")
    for key, value in summary.items():
        if key == "units" or isinstance(value, list):  # in summary.json, for the reader of the file
            continue
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"  {key:26s} {shown}")


def cmd_train(args: argparse.Namespace, train_fn: Callable[..., dict] | None = None) -> int:
    from tether.train.run_state import RunStopped, finished_line
    from tether.train.sharding import leave_ranks

    cfg = None
    try:
        cfg = _config(args)
        cfg = settle_nproc(cfg, given=args.nproc is not None or cfg.nproc != 1).validate()
        finished = finished_line(cfg) if args.resume else None  # checked as a resume would be
        if finished is not None:
            if not int(os.environ.get("RANK", "0")):
                print(finished)
            return 0
        if needs_launch(cfg):  # the launching process trains nothing; a copied recipe's ranks run the copy
            return launch(args.argv, cfg.nproc, script=None if train_fn is None else _recipe_of(train_fn).__file__)
        with interrupts_reach_the_run():
            summary = _train_fn(cfg, train_fn)(cfg, resume=bool(args.resume), progress=not args.quiet)
        leave_ranks()  # a sharded run: every rank ends its process group together
    except (*_USER_ERRORS, RunStopped) as exc:  # RunStopped: a process the run needs died; the line says why
        return _fail("train", exc)
    except KeyboardInterrupt as exc:  # Ctrl-C: one line naming the checkpoint to resume from, status 130
        return report_interruption(cfg, exc, copied=train_fn is not None)
    if int(os.environ.get("RANK", "0")):
        return 0  # rank 0 alone reports a sharded run
    _print_summary(summary)
    print(f"  run directory              {cfg.out}")
    return 0


def _train_fn(cfg: TrainConfig, given: Callable[..., dict] | None) -> Callable[..., dict]:
    """The recipe that runs ``cfg``: a copied recipe's own ``train`` (its stages on sharded ranks
    with ``nproc > 1``), the Ray recipe with ``workers > 0``, the sharded one with ``nproc > 1``,
    else the single-process one."""
    from tether.train import recipe_sharded

    if given is not None:
        if cfg.workers > 0:
            raise ValueError(f"workers={cfg.workers}: a copied recipe runs in one process; run the Ray topology "
                             "with tether train --workers N, or copy tether.train.recipe_ray too.")
        return functools.partial(recipe_sharded.train, recipe=_recipe_of(given)) if cfg.nproc > 1 else given
    if cfg.workers > 0:
        from tether.train.recipe_ray import train
    elif cfg.nproc > 1:
        train = recipe_sharded.train
    else:
        from tether.train.recipe import train
    return train


def _recipe_of(train_fn: Callable[..., dict]) -> ModuleType:
    """The module (a copied recipe's file) whose ``train`` is ``train_fn``."""
    return sys.modules[train_fn.__module__]


def cmd_cp(args: argparse.Namespace) -> int:
    """Copy a shipped recipe to a file of the user's, to change and run with ``python FILE``."""
    import importlib.util
    import shutil

    try:
        source = importlib.util.find_spec(f"tether.train.{RECIPES[args.recipe]}").origin
        dest = Path(args.dest)
        if dest.exists() and not args.force:
            raise ValueError(f"{dest}: exists; pass --force to replace it, or choose another path.")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
    except _USER_ERRORS as exc:
        return _fail("cp", exc)
    print(f"tether cp: wrote {dest} (from tether.train.{RECIPES[args.recipe]}); run it with: python {dest} [tether train flags]")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    try:
        return _eval(args)
    except _USER_ERRORS as exc:
        return _fail("eval", exc)


def _eval(args: argparse.Namespace) -> int:
    from tether.train.checkpoint import open_checkpoint
    from tether.train.run_dir import RESUMABLE_KEYS, best_root, read_run_config
    from tether.train.metrics import evaluate
    from tether.train.run import build_run

    if args.run:
        cfg = read_run_config(Path(args.run))
        code = [f for f in (None if cfg.task in TASKS else cfg.task, cfg.reward_funcs) if f]
        if code and not args.trust_task_code:
            # A run directory is data: running the code it names needs the user's say-so.
            raise ValueError(
                f"{Path(args.run) / 'config.yaml'} names the task or reward file {' and '.join(code)}, which would "
                "run as Python code. Pass --trust-task-code if you trust that file."
            )
    else:
        cfg = TrainConfig().override({"model": args.model, "task": args.task, "out": "runs/eval"})
    cfg = cfg.override({"eval_size": args.eval_size}) if args.eval_size else cfg
    cfg = cfg.override({"nproc": 1})  # a sharded run's checkpoint holds whole tensors: one process scores it
    if args.best and not args.run:
        raise ValueError("--best: give the run directory whose best checkpoint to score (tether eval RUN --best).")
    root = best_root(Path(args.run), required=True) if args.best else None
    run = build_run(cfg)
    scored: dict[str, object] = {"checkpoint": None, "step": 0}
    if args.run:
        ckpt, _ = open_checkpoint(cfg, run.models, run.optimizer, allowed=(*RESUMABLE_KEYS, "eval_size", "nproc"),
                                  root=root)
        scored = {"checkpoint": str(ckpt.path), "step": ckpt.step}
        what = f"{ckpt.path} (step {ckpt.step} of {cfg.steps})"
    else:
        what = f"the untrained model {cfg.model!r} (step 0)"
    print(f"tether eval: scoring {what} on {len(run.held_out)} held-out problems", file=sys.stderr)
    result = evaluate(run.models.policy, run.models.reference, run.models.tokenizer, run.task, run.held_out,
                      max_new_tokens=cfg.eval_max_new_tokens, temperature=cfg.temperature,
                      reward=run.reward, prompt_format=cfg.prompt_format, progress=True)
    print(json.dumps({**scored, **result.as_dict()}, indent=1))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tether.train.export import export_run

    try:
        result = export_run(args.run_dir, args.out, merge=args.merge, best=args.best, push_to_hub=args.push_to_hub)
    except _USER_ERRORS as exc:
        return _fail("export", exc)
    print(f"tether export: wrote the {result.kind} model of step {result.step} ({result.checkpoint}) to {result.out}")
    if result.pushed:
        print(f"tether export: pushed {result.out} to {result.pushed}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from tether.train.plots import plot_metrics

    try:
        paths = plot_metrics(Path(args.run_dir))
    except _USER_ERRORS as exc:
        return _fail("plot", exc)
    for path in paths:
        print(path)
    return 0


def main(argv: list[str] | None = None, *, train_fn: Callable[..., dict] | None = None) -> int:
    """The ``tether`` command; ``train_fn`` replaces the recipe of ``train`` (a copied recipe's ``main``)."""
    parser = Parser(prog="tether", description="RL post-training of LLMs on a KL leash.")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    e = sub.add_parser("eval", help="Held-out accuracy and KL of a run's last checkpoint or of an untrained model.")
    e.add_argument("run", nargs="?", help="Run directory (its config.yaml and last checkpoint).")
    e.add_argument("--model", default="default", help="Model when no run directory is given.")
    e.add_argument("--task", default="arithmetic", help="Task when no run directory is given.")
    e.add_argument("--eval-size", type=int, default=0, help="Override the held-out set size.")
    e.add_argument("--trust-task-code", action="store_true",
                   help="Run the task or reward-functions .py file named in RUN's config.yaml (code from the run directory).")
    e.add_argument("--best", action="store_true", help="Score RUN's best checkpoint (best/, kept by eval_every).")
    x = sub.add_parser("export", help="Write a run's policy as a Hugging Face model (or PEFT adapter) directory.")
    x.add_argument("run_dir", metavar="RUN_DIR")
    x.add_argument("out", metavar="OUT", help="New directory to write (refused if it exists and is not empty).")
    x.add_argument("--merge", action="store_true", help="LoRA runs: merge the adapter into the base and write "
                   "the whole model; without it the adapter alone is written (a full fine-tune is always whole).")
    x.add_argument("--best", action="store_true", help="Export the best checkpoint (best/, kept by eval_every).")
    x.add_argument("--push-to-hub", metavar="REPO", default="", help="Also write a model card (README.md, figures/) "
                   "and upload OUT to the Hugging Face Hub model repo REPO (needs a token and network).")
    pl = sub.add_parser("plot", help="Write PNG plots of a run's metrics.jsonl.")
    pl.add_argument("run_dir")
    c = sub.add_parser("cp", help="Copy a recipe's source to DEST to change it; run the copy with python DEST [flags].")
    c.add_argument("recipe", choices=sorted(RECIPES), help="recipe: one process; recipe_ray: rollouts on Ray workers.")
    c.add_argument("dest", metavar="DEST", help="The .py file to write.")
    c.add_argument("--force", action="store_true", help="Replace DEST if it exists.")
    args, unknown = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)[1:]  # the words after the subcommand
    if unknown:  # reported by the subcommand's parser, which knows its flags for a suggestion
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "push_to_hub", ""):  # the one command that asks for the network
        # Every from_pretrained call already passes local_files_only; this also covers code that
        # the user's task or reward file runs, and libraries imported after this point.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    handlers = {"train": lambda a: cmd_train(a, train_fn), "eval": cmd_eval, "export": cmd_export, "plot": cmd_plot,
                "cp": cmd_cp}
    shown = warnings.formatwarning
    warnings.formatwarning = _warning_format(shown)
    try:
        return handlers[args.command](args)
    finally:
        warnings.formatwarning = shown


def _warning_format(python_format: Callable[..., str]) -> Callable[..., str]:
    """tether's own warnings (a skipped damaged checkpoint, a TRL name read) as one plain line, not
    with tether's source line; another library's warning keeps Python's form, naming its file, so
    it is not taken for tether's. A warning is tether's when its category is defined in tether."""

    def format_warning(message, category, filename, lineno, line=None) -> str:
        if category.__module__.partition(".")[0] == "tether":
            return f"tether: {category.__name__}: {message}\n"
        return python_format(message, category, filename, lineno, line)

    return format_warning


# ------------------------------------------------------------------------------ --nproc N
# The command runs itself again as ``python -m torch.distributed.run --nproc-per-node N --master-addr
# 127.0.0.1 --master-port PORT -m tether.train train ...`` with the same arguments; each process then
# joins the group in ``tether.train.sharding.join_ranks``. Started by torchrun directly (``torchrun
# --nproc_per_node N -m tether.train ...``), ``nproc`` is taken from the world size and a different
# ``--nproc`` is refused. The port is a free one on the loopback interface, so runs do not collide.
LAUNCHED_ENV = "TETHER_LAUNCHED"  # set in the processes ``launch`` starts (``speaks`` reads it)


def world_size() -> int:
    """Processes in the torchrun group this process belongs to (1 when not started by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def settle_nproc(cfg: TrainConfig, *, given: bool) -> TrainConfig:
    """``cfg`` with ``nproc`` equal to the torchrun world size when started by torchrun.

    ``given`` says whether ``nproc`` was set (a flag, or a value other than 1 from a config
    file or the run being resumed); then it must equal the world size.
    """
    world = world_size()
    if world == 1 or cfg.nproc == world:
        return cfg
    if given:
        raise ValueError(f"nproc: {cfg.nproc} learner processes asked for, but torchrun started {world} "
                         f"(WORLD_SIZE={world}); start torchrun with --nproc_per_node {cfg.nproc}, or drop --nproc.")
    return cfg.override({"nproc": world})


def needs_launch(cfg: TrainConfig) -> bool:
    """Whether this process has to start the learner's processes itself."""
    return cfg.nproc > 1 and world_size() == 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_command(argv: list[str], nproc: int, port: int, *, script: str | None = None) -> list[str]:
    """The command that runs ``tether train`` with ``argv`` in ``nproc`` processes on this machine;
    with ``script`` (a copied recipe's file) each process runs ``python script argv`` instead.

    ``--nproc`` is left out: torchrun would read it as its own ``--nproc-per-node`` (argparse
    matches prefixes), and each process takes ``nproc`` from the world size instead.
    """
    words, skip = [], False
    for word in argv:
        if not skip and word != "--nproc" and not word.startswith("--nproc="):
            words.append(word)
        skip = word == "--nproc"
    target = [script] if script else ["-m", "tether.train", "train"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1", f"--master-port={port}", *target, *words]


def launch(argv: list[str], nproc: int, *, script: str | None = None) -> int:
    """Run ``tether train argv`` (or ``python script argv``) in ``nproc`` processes; torchrun's exit status."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), LAUNCHED_ENV: "1"}
    return subprocess.run(torchrun_command(argv, nproc, free_port(), script=script), env=env, check=False).returncode


# ------------------------------------------------------------------------------ Ctrl-C
# The newest intact checkpoint is where a resume starts, as after a kill. Of a sharded run one
# process speaks: the launcher ``--nproc`` starts (its ranks stay silent), or rank 0 under a
# torchrun the user started. 130 is the shell's status for a process ended by SIGINT.
INTERRUPTED = 130  # 128 + SIGINT


def speaks() -> bool:
    """Whether this process reports the interruption (one line for the whole run)."""
    rank = os.environ.get("RANK")
    return rank is None or (rank == "0" and LAUNCHED_ENV not in os.environ)


def resume_command(run_dir: Path, *, copied: bool) -> str:
    """The command that continues ``run_dir``: ``tether train --resume RUN`` as this program was
    started (``.venv/bin/tether`` stays so), or ``python COPY --resume RUN`` for a copied recipe."""
    program = sys.argv[0] if sys.argv and sys.argv[0] else "tether"
    if copied:
        start = f"python {shlex.quote(program)}"
    else:
        start = f"{shlex.quote(program) if Path(program).name == 'tether' else 'tether'} train"
    return f"{start} --resume {shlex.quote(str(run_dir))}"


def interruption_line(cfg: TrainConfig | None, *, copied: bool) -> str:
    """The one line for a run stopped by Ctrl-C: its newest intact checkpoint and how to go on."""
    if cfg is None:
        return "tether train: interrupted before the run started; nothing was written."
    from tether.train.checkpoint import CheckpointError, newest_intact, read_state
    from tether.train.run_files import checkpoint_dirs

    run_dir = Path(cfg.out)
    try:
        path, _ = newest_intact(run_dir)
        step = int(read_state(path)["step"])
    except CheckpointError:
        if (run_dir / "config.yaml").is_file() and not checkpoint_dirs(run_dir):  # --resume starts it again
            return (f"tether train: interrupted before the first checkpoint of {run_dir}; nothing was lost: "
                    f"{resume_command(run_dir, copied=copied)} starts it again from step 0 with its config.yaml.")
        again = " with --overwrite" if run_dir.is_dir() and any(run_dir.iterdir()) else ""
        return (f"tether train: interrupted before the first checkpoint of {run_dir}: no checkpoint exists yet, so "
                f"there is nothing to resume; run the same command again{again} to start over.")
    return (f"tether train: interrupted; the newest intact checkpoint is {path} (step {step} of {cfg.steps}); "
            f"continue with: {resume_command(run_dir, copied=copied)}")


def report_interruption(cfg: TrainConfig | None, exc: KeyboardInterrupt, *, copied: bool) -> int:
    """Print ``interruption_line`` (from the one process that speaks) and return 130."""
    # Free the interrupted frames first: a progress bar they hold then ends its line before ours.
    traceback.clear_frames(exc.__traceback__)
    try:  # a second Ctrl-C while the checkpoints are verified would print a traceback after all
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals cannot be set here
        previous = None
    try:
        if speaks():
            print(interruption_line(cfg, copied=copied), file=sys.stderr, flush=True)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return INTERRUPTED


@contextlib.contextmanager
def interrupts_reach_the_run() -> Iterator[None]:
    """Within: a KeyboardInterrupt raised in a finaliser, which Python reports as unraisable and
    drops, is raised again in the main thread instead, with nothing printed."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            # From another thread: raised here, inside the hook, Python would drop it again.
            _thread.start_new_thread(_thread.interrupt_main, ())  # no wait for it to start
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


if __name__ == "__main__":
    raise SystemExit(main())
