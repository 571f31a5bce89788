"""``python -m tether.train ...`` (and ``torchrun ... -m tether.train ...``): the ``tether`` command.

Words that do not start with a subcommand are ``train``'s: ``-m tether.train --steps 2`` is
``tether train --steps 2``.
"""

from __future__ import annotations

import sys

from tether.train.cli import SUBCOMMANDS, main

if __name__ == "__main__":
    words = sys.argv[1:]
    raise SystemExit(main(words if words and words[0] in SUBCOMMANDS + ("-h", "--help") else ["train", *words]))
