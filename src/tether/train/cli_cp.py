"""``tether cp RECIPE DEST``: a shipped recipe's source copied to a file of the user's.

The copy is a program: ``python DEST [tether train flags]`` runs it like ``tether train``
(``tether.train.train_command.main``), so a change to the copy is a change to the algorithm.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
from pathlib import Path

from tether.train.reporting import USER_ERRORS, fail

# The recipes ``tether cp`` copies: name -> module of tether.train.
RECIPES = {"recipe": "recipe", "recipe_ray": "recipe_ray"}
# What a copy needs on its command line besides the train flags: the Ray recipe samples on workers.
_NEEDS = {"recipe_ray": " --workers N"}


def add_parser(sub) -> None:
    c = sub.add_parser("cp", help="Copy a recipe's source to DEST to change it; run the copy with python DEST [flags].")
    c.add_argument("recipe", choices=sorted(RECIPES), help="recipe: one process; recipe_ray: rollouts on Ray workers.")
    c.add_argument("dest", metavar="DEST", help="The .py file to write.")
    c.add_argument("--force", action="store_true", help="Replace DEST if it exists.")


def run(args: argparse.Namespace) -> int:
    """Copy a shipped recipe to a file of the user's, to change and run with ``python FILE``."""
    try:
        source = importlib.util.find_spec(f"tether.train.{RECIPES[args.recipe]}").origin
        dest = Path(args.dest)
        if dest.exists() and not args.force:
            raise ValueError(f"{dest}: exists; pass --force to replace it, or choose another path.")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
    except USER_ERRORS as exc:
        return fail("cp", exc)
    print(f"tether cp: wrote {dest} (from tether.train.{RECIPES[args.recipe]}); run it with: "
          f"python {dest}{_NEEDS.get(args.recipe, '')} [tether train flags]")
    return 0
