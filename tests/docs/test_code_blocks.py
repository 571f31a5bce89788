"""Every ```python and ```bash block of the README and the docs runs, in reading order.

The blocks of all pages share one working directory, as a reader's checkout would: a run that
one page makes is exported on a later page. ``.venv/bin/tether`` and ``.venv/bin/python`` in
that directory (and ``tether`` on its PATH) are this interpreter, so the blocks run the tether
under test; ``examples/`` and ``tests/`` are links to the checkout's. Blocks marked
``no-run`` say why; ``test-with`` shrinks a real job to the tiny model (tests/docs/blocks.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT, RUN_LANGUAGES, SHOWN_LANGUAGES, read_blocks, reading_order

BLOCK_TIMEOUT_S = 240
PAGES = reading_order()

_TETHER_SHIM = """#!/usr/bin/env bash
# The page's `tether train ...` with the block's test-with arguments appended (flags given
# later win, so `--steps 2` here overrides the page's `--steps 16`).
if [ "${{1:-}}" = train ] && [ -n "${{DOCS_TRAIN_ARGS:-}}" ]; then set -- "$@" $DOCS_TRAIN_ARGS; fi
exec {python} -m tether.train "$@"
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("reader")
    for name in ("examples", "tests"):
        (work / name).symlink_to(ROOT / name)
    bin_dir = work / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    shims = {"tether": _TETHER_SHIM.format(python=sys.executable),
             "python": f'#!/usr/bin/env bash\nexec {sys.executable} "$@"\n'}
    for name, text in shims.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (work / "runs").mkdir()
    return work


def _env(work: Path, train_args: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{work / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # The checkout's src first, whether tether is installed editable or not.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH")]))
    env.update(HF_HUB_OFFLINE="1", MPLBACKEND="Agg", DOCS_TRAIN_ARGS=train_args,
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    return env


def test_every_page_is_in_the_reading_order():
    pages = set(PAGES)
    missing = [p.relative_to(ROOT) for p in (ROOT / "docs").rglob("*.md") if p not in pages]
    assert not missing, f"pages outside mkdocs.yml's nav (their blocks would never run): {missing}"


def test_blocks_are_found_and_few_are_skipped():
    blocks = [b for page in PAGES for b in read_blocks(page)]
    odd = [b.where() for b in blocks if b.language not in RUN_LANGUAGES + SHOWN_LANGUAGES]
    assert not odd, f"blocks in a language the runner neither runs nor shows on purpose: {odd}"
    run = [b for b in blocks if b.language in RUN_LANGUAGES]
    skipped = [b for b in run if b.no_run]
    assert len(run) >= 15 and len(skipped) <= len(run) // 2, (len(run), [b.where() for b in skipped])


@pytest.mark.docs
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_code_blocks_run(page: Path, workdir: Path):
    for block in read_blocks(page):
        if block.language not in RUN_LANGUAGES or block.no_run:
            continue
        code = block.runnable_code()
        if block.language == "python":
            script = workdir / "_block.py"
            script.write_text(code)
            command = [sys.executable, str(script)]
        else:
            command = ["bash", "-e", "-c", code]
        try:
            done = subprocess.run(command, cwd=workdir, env=_env(workdir, block.train_args),
                                  capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block.where()}: ran past {BLOCK_TIMEOUT_S} s")
        output = (done.stdout + done.stderr)[-3000:]
        assert done.returncode == 0, f"{block.where()} exited {done.returncode}:\n{output}"


def test_shell_commands_name_the_venv_they_run_in():
    """A reader without an activated venv gets 'command not found' from a bare ``tether`` (or
    ``torchrun``/``mkdocs``): every bash line, run or not, calls them through ``.venv/bin/``."""
    bare = re.compile(r"^\s*(tether|torchrun|mkdocs|pytest)\s")
    found = [f"{block.where()}: {line.strip()}" for page in PAGES for block in read_blocks(page)
             if block.language == "bash" for line in block.code.splitlines() if bare.match(line)]
    assert not found, "bare commands (use .venv/bin/...):\n" + "\n".join(found)
