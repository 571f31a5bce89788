"""The documentation site builds with ``mkdocs build --strict``, and what it must hold is there.

Built once per session (about 20 s): a broken link, an anchor that does not exist, a page
outside the nav or an API name mkdocstrings cannot resolve fails the build. The README, which
the site does not render, is checked here for its length and its links.
"""

from __future__ import annotations

import ast
import html
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT, read_blocks

BUILD_TIMEOUT_S = 300
# SPEC section 11's CLI flags: public names that outside checks use.
SPEC_FLAGS = ["--dataset", "--prompt-column", "--prompt-format", "--eval-dataset", "--eval-split",
              "--reward-funcs", "--reward-weights", "--reward-model", "--adapter", "--dtype", "--device",
              "--gradient-checkpointing", "--report-to", "--log-completions-every",
              "--updates-per-rollout", "--lr-schedule", "--warmup-steps", "--eval-every", "--overwrite",
              "--keep-checkpoints", "--nproc"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{(done.stdout + done.stderr)[-4000:]}"
    return out


def _page(site: Path, name: str) -> str:
    return (site / f"{name}.html").read_text()


def _exports(package: str) -> list[str]:
    tree = ast.parse((ROOT / "src" / "tether" / package / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"tether.{package} has no __all__ for its API page to render")


@pytest.mark.parametrize("package", ["ops", "models", "llm", "transforms", "objectives", "control",
                                     "rollout", "ray"])
def test_api_page_renders_every_export(site, package):
    page = _page(site, f"reference/api/{package}")
    # A name shared with its own submodule (tether.ops.aggregate) is rendered from that module.
    missing = [n for n in _exports(package)
               if f'id="tether.{package}.{n}"' not in page and f'id="tether.{package}.{n}.{n}"' not in page]
    assert not missing, f"reference/api/{package} lacks {missing}"


def test_train_page_renders_the_public_recipe_names(site):
    page = _page(site, "reference/api/train")
    for name in ("tether.train.config.TrainConfig", "tether.train.tasks.Task", "tether.train.export.export_run"):
        assert f'id="{name}"' in page, name


def test_config_reference_is_the_dataclass(site):
    from tether.train.config import TrainConfig

    page = html.unescape(re.sub(r"<[^>]+>", "", _page(site, "reference/config")))
    for f in fields(TrainConfig):
        flag = f"--{f.name.replace('_', '-')}"
        assert f"\n{flag}\n" in page, flag
        # Backticks in a help text render as code on the page, so they leave no character.
        assert f.metadata["help"].replace("`", "") in page, f"{flag}: help text not rendered as written"
    assert all(flag in page for flag in SPEC_FLAGS)


def test_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    broken = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert targets and not broken, broken


def test_readme_quickstart_fits_in_30_lines():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Quickstart")
    end = readme.index("\n## ", start + 1)
    lines = sum(len(b.code.splitlines()) for b in read_blocks(ROOT / "README.md")
                if start < readme.index(b.code) < end)
    assert 5 < lines <= 30, lines


def test_links_open_from_disk(site):
    """``use_directory_urls: false``: every internal link names a file (``page.html``), so the site
    browses from ``site/index.html`` without a server; a link to a folder shows a listing there."""
    folders = sorted({link for page in site.rglob("*.html")
                      for link in re.findall(r'href="([^"#:]*/)"', page.read_text())})
    assert not folders, folders
    assert (site / "reference" / "api" / "objectives.html").exists()


def test_pages_name_torchrl_not_the_project_notes():
    """"SPEC §3" or "the seed's code" points at notes a reader does not have: say TorchRL."""
    pattern = re.compile(r"\bSPEC\b|the TorchRL seed|\b[Tt]he seed's\b|\b[Tt]he seeds'|\(the seed\)")
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [f"{p.relative_to(ROOT)}:{n}" for p in pages
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found
