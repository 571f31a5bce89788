"""The run directory and its checkpoints: what a run writes so that nothing is lost.

``checkpoints/step_NNNNNN/`` holds ``policy.safetensors`` (trainable parameters),
``reference.safetensors`` (only when the reference moves), ``average.safetensors`` (only with
``weight_average``), ``optimizer.safetensors``, ``rng.safetensors``, ``state.json`` (step, data
cursor, controller and reference state) and ``manifest.json`` (size and SHA-256 of every other
file, written last). It is written beside and renamed into place, so a killed process leaves the
previous checkpoint intact; the newest ``keep`` are kept and ``newest_intact`` picks the newest
the manifest vouches for. Nothing is pickled. A sharded learner writes the same files (rank 0
writes the gathered tensors); a resume on another world size is refused (the sums would round
differently).

A checkpoint records the run's config and the fingerprint of its base model and tokenizer
(``checkpoint_record``); loading one checks both against the run (``check_record``): what a
resume may change is ``tether.train.run_dir``'s rule. A damaged newest checkpoint is skipped
with a warning, and set aside on resume.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

from tether._compat import disk_full
from tether.models.weights import load_named
from tether.train.config import TrainConfig
from tether.train.run_dir import NOT_COMPARED, RESUMABLE_KEYS, changed_keys
from tether.train.run_files import checkpoint_dirs
from tether.train.sharded_hold import shard_like
from tether.train.sharding import is_writer


MANIFEST = "manifest.json"
_STATE_KEYS = ("step", "optimizer", "data_cursor", "controller")


class CheckpointError(ValueError):
    """A checkpoint is damaged, missing, or does not fit the model it is loaded into."""


@dataclass
class Checkpoint:
    """What ``load_checkpoint`` returns; tensors are already loaded into the given objects."""

    step: int
    state: dict[str, Any]
    path: Path


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded one is gathered from every rank (all ranks must call this)."""
    tensor = tensor.detach()
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).contiguous()


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}


def _as_params(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters(remove_duplicate=False))
    return {n: shard_like(v, params[n]) if n in params else v for n, v in weights.items()}


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, entry in sd["state"].items():
        for name, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = _full(value)
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for key, value in list(tensors.items()) + list(meta["scalars"].items()):
        idx, name = key.split(".", 1)
        sharded = torch.is_tensor(value) and int(idx) < len(params) and value.shape == params[int(idx)].shape
        state.setdefault(int(idx), {})[name] = shard_like(value, params[int(idx)]) if sharded else value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    rng: dict[str, torch.Tensor],
    reference: nn.Module | None = None,
    keep: int = 2,
    average: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` atomically and drop all but the newest ``keep``.

    Every rank of a sharded learner calls this (the tensors are gathered); rank 0 writes.
    ``average``: ``weight_average``'s running average, saved as ``average.safetensors``."""
    weights = _trainable(policy)
    ref = None if reference is None else {n: _full(p) for n, p in reference.named_parameters()}
    opt_tensors, opt_meta = _optimizer_tensors(optimizer)
    root = run_dir / "checkpoints"
    final = root / f"step_{step:06d}"
    if not is_writer():
        return final
    tensors = {"policy": weights, "reference": ref, "optimizer": opt_tensors,
               "rng": {k: v.contiguous() for k, v in rng.items()}, "average": average}
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_files(tmp, tensors, json.dumps({"step": step, "optimizer": opt_meta, **state}, indent=1))
    except Exception as exc:  # OSError, or safetensors' own error type carrying the OS error
        if not disk_full(exc):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # the partial files: their space back, nothing else touched
        raise CheckpointError(_disk_full_line(run_dir, final, tensors)) from None
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    for old in checkpoint_dirs(run_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_files(tmp: Path, tensors: dict[str, dict[str, torch.Tensor] | None], state: str) -> None:
    """The checkpoint's files in ``tmp``, the manifest last."""
    tmp.mkdir()
    for name, group in tensors.items():
        if group is not None:
            save_file(group, str(tmp / f"{name}.safetensors"))
    (tmp / "state.json").write_text(state)
    manifest = {f.name: _file_entry(f) for f in sorted(tmp.iterdir())}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _disk_full_line(run_dir: Path, final: Path, tensors: dict[str, dict[str, torch.Tensor] | None]) -> str:
    """One line for a disk that filled during a checkpoint: the path, the bytes it needs, what is
    intact, and the command that goes on once space is freed."""
    needed = sum(t.numel() * t.element_size() for group in tensors.values() if group for t in group.values())
    free = shutil.disk_usage(final.parent).free
    previous = checkpoint_dirs(run_dir)
    intact = (f"the newest checkpoint, {previous[0]}, is intact" if previous else
              "no checkpoint was written before, so the resume starts again from step 0 with the run's config.yaml")
    return (f"{final}: the disk filled while this checkpoint was written (it needs about {needed} bytes; {free} are "
            f"free on that disk); the partial files were removed and nothing was lost: {intact}. Free at least "
            f"{needed} bytes, then continue with: tether train --resume {run_dir}")


def _file_entry(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def verify_checkpoint(path: Path) -> None:
    """Raise ``CheckpointError`` naming the file of ``path`` that is missing, truncated or edited."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path / MANIFEST}: missing, so the checkpoint cannot be verified.") from None
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{path / MANIFEST}: not readable JSON ({exc}); the file is damaged.") from exc
    for name, want in manifest.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (the checkpoint's manifest lists it).")
        got = _file_entry(file)
        if got["bytes"] != want["bytes"]:
            raise CheckpointError(f"{file}: {got['bytes']} bytes, the manifest says {want['bytes']} (truncated or replaced).")
        if got["sha256"] != want["sha256"]:
            raise CheckpointError(f"{file}: contents differ from the manifest's SHA-256 (damaged or edited).")
    for name in ("policy.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"):
        if name not in manifest:
            raise CheckpointError(f"{path / MANIFEST}: does not list {name}; the checkpoint is incomplete.")


def newest_intact(run_dir: Path) -> tuple[Path, list[str]]:
    """The newest checkpoint that verifies, and why each newer one was skipped."""
    skipped: list[str] = []
    for path in checkpoint_dirs(run_dir):
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        return path, skipped
    if not skipped:
        raise CheckpointError(f"{run_dir / 'checkpoints'}: no checkpoint (no step_* directory) to load.")
    raise CheckpointError(f"{run_dir / 'checkpoints'}: no intact checkpoint: " + " ".join(skipped))


def read_state(path: Path) -> dict[str, Any]:
    """``state.json`` of the checkpoint ``path``, with the entries every checkpoint has."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / 'state.json'}: not readable JSON ({exc}).") from exc
    absent = [key for key in _STATE_KEYS if not isinstance(state, dict) or key not in state]
    if absent:
        raise CheckpointError(f"{path / 'state.json'}: missing the entries {absent}.")
    return state


def load_checkpoint(
    path: Path,
    *,
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    reference: nn.Module | None = None,
) -> tuple[Checkpoint, dict[str, torch.Tensor]]:
    """Load weights and optimizer state in place; return the JSON state and the RNG tensors."""
    weights = load_file(str(path / "policy.safetensors"))
    _check_fits(path / "policy.safetensors", weights,
                {n: p for n, p in policy.named_parameters() if p.requires_grad})
    load_named(policy, _as_params(policy, weights), owner=f"the policy ({path / 'policy.safetensors'})", fix=_REFIT)
    if reference is not None and (path / "reference.safetensors").is_file():
        load_named(reference, _as_params(reference, load_file(str(path / "reference.safetensors"))),
                   owner=f"the reference ({path / 'reference.safetensors'})", fix=_REFIT)
    state = read_state(path)
    _restore_optimizer(optimizer, load_file(str(path / "optimizer.safetensors")), state.pop("optimizer"))
    rng = load_file(str(path / "rng.safetensors"))
    return Checkpoint(step=int(state["step"]), state=state, path=path), rng


_REFIT = "Was config.yaml's model, lora_rank or lora_targets changed since the run started?"


def _check_fits(file: Path, saved: dict[str, torch.Tensor], model: dict[str, torch.Tensor]) -> None:
    """Every trainable parameter of the model is in ``saved``, with the same shape, and no other."""
    problems = [f"{n} is not in the model" for n in sorted(set(saved) - set(model))[:3]]
    problems += [f"{n} is missing" for n in sorted(set(model) - set(saved))[:3]]
    problems += [f"{n} has shape {list(saved[n].shape)}, the model's is {list(model[n].shape)}"
                 for n in sorted(set(saved) & set(model)) if saved[n].shape != model[n].shape][:3]
    if problems:
        raise CheckpointError(
            f"{file}: does not fit the policy built from the run's config ({'; '.join(problems)}); "
            "was config.yaml's model, lora_rank or lora_targets changed since the run started?"
        )


class CheckpointFallbackWarning(UserWarning):
    """The newest checkpoint was damaged; an older intact one was used instead."""


def checkpoint_record(cfg: TrainConfig, fingerprint: dict[str, str]) -> dict[str, Any]:
    """What a checkpoint records about its run: the config and the base it was trained on."""
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_COMPARED}
    return {"config": config, "base": {"model": cfg.model, **fingerprint}}


def check_record(path: Path, state: dict[str, Any], cfg: TrainConfig, fingerprint: dict[str, str],
                  allowed: tuple[str, ...]) -> None:
    absent = [key for key in ("config", "base") if key not in state]
    if absent:
        raise CheckpointError(f"{path / 'state.json'}: missing the entries {absent}.")
    changed = changed_keys(state["config"], cfg, allowed)
    if changed:
        raise CheckpointError(
            f"{path}: written with another config than {cfg.out}/config.yaml: {', '.join(changed)}. Only "
            f"{', '.join(allowed)} may differ; restore config.yaml, or start a new run in another directory."
        )
    base = state["base"]
    if "adapter" in fingerprint and base.get("adapter") != fingerprint["adapter"]:
        raise CheckpointError(
            f"{path}: trained from another adapter than the one now in {cfg.adapter} (digest "
            f"{str(base.get('adapter'))[:12]} then, {fingerprint['adapter'][:12]} now), so the run's reference "
            "would change; restore that adapter directory, or start a new run in another directory."
        )
    if {k: base.get(k) for k in fingerprint} != fingerprint:
        raise CheckpointError(
            f"{path}: trained on base model {base.get('model')!r} (weights {str(base.get('weights'))[:12]}, "
            f"tokenizer {str(base.get('tokenizer'))[:12]}), but model {cfg.model!r} now loads weights "
            f"{fingerprint['weights'][:12]}, tokenizer {fingerprint['tokenizer'][:12]}. The checkpoint's "
            "weights belong to the first; point model at that base."
        )


def open_checkpoint(cfg: TrainConfig, models: Any, optimizer: torch.optim.Optimizer, *,
                    allowed: tuple[str, ...] = RESUMABLE_KEYS, set_aside: bool = False,
                    root: Path | None = None) -> tuple[Checkpoint, dict[str, torch.Tensor]]:
    """Load the newest intact checkpoint of ``cfg.out`` into ``models``/``optimizer`` after checking
    that it was written by this config on this base; warn about (and optionally set aside) newer
    damaged ones. ``root`` reads the checkpoints of another directory of the run (``best/``)."""
    run_dir = Path(root or cfg.out)
    path, skipped = newest_intact(run_dir)
    state = read_state(path)
    check_record(path, state, cfg, models.fingerprint, allowed)
    if skipped:
        warnings.warn(f"{' '.join(skipped)} Using the newest intact checkpoint, {path}.",
                      CheckpointFallbackWarning, stacklevel=2)
    if set_aside:
        for newer in checkpoint_dirs(run_dir):
            if newer == path:
                break
            target, n = newer.with_name(newer.name + ".damaged"), 1
            while target.exists():
                target, n = newer.with_name(f"{newer.name}.damaged{n}"), n + 1
            os.replace(newer, target)
    return load_checkpoint(path, policy=models.policy, optimizer=optimizer,
                           reference=models.movable_reference)
