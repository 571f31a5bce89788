"""Checkpoints of a training run: safetensors for every tensor, JSON for the rest.

A checkpoint directory ``checkpoints/step_NNNNNN/`` holds

* ``policy.safetensors``: the trainable parameters (LoRA adapters, or every weight);
* ``reference.safetensors``: the reference weights, only when the reference moves (sync/EMA);
* ``optimizer.safetensors`` + the param groups in ``state.json``;
* ``rng.safetensors``: the global torch RNG and the sampling generator;
* ``state.json``: step, data cursor, controller and reference-updater state.

It is written to a temporary directory and renamed into place, then ``checkpoints/latest``
is replaced, so a process killed at any point leaves the previous checkpoint intact. Only the
newest checkpoint is kept. Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn


@dataclass
class Checkpoint:
    """What ``load_checkpoint`` returns; tensors are already loaded into the given objects."""

    step: int
    state: dict[str, Any]
    path: Path


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, entry in sd["state"].items():
        for name, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = value.contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in list(tensors.items()) + list(meta["scalars"].items()):
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
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
) -> Path:
    """Write the checkpoint of ``step`` atomically and drop the older ones."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(_trainable(policy), str(tmp / "policy.safetensors"))
    if reference is not None:
        ref = {n: p.detach().contiguous() for n, p in reference.named_parameters()}
        save_file(ref, str(tmp / "reference.safetensors"))
    opt_tensors, opt_meta = _optimizer_tensors(optimizer)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    save_file({k: v.contiguous() for k, v in rng.items()}, str(tmp / "rng.safetensors"))
    (tmp / "state.json").write_text(json.dumps({"step": step, "optimizer": opt_meta, **state}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    for old in root.glob("step_*"):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    return path if path.is_dir() else None


def load_checkpoint(
    path: Path,
    *,
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    reference: nn.Module | None = None,
) -> tuple[Checkpoint, dict[str, torch.Tensor]]:
    """Load weights and optimizer state in place; return the JSON state and the RNG tensors."""
    weights = load_file(str(path / "policy.safetensors"))
    params = dict(policy.named_parameters())
    missing = sorted(set(weights) - set(params))
    if missing:
        raise KeyError(
            f"checkpoint {path}: parameters {missing[:5]} are not in the policy; was the run "
            "started with another --model or lora_rank?"
        )
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
        if reference is not None and (path / "reference.safetensors").is_file():
            ref_params = dict(reference.named_parameters())
            for name, value in load_file(str(path / "reference.safetensors")).items():
                ref_params[name].copy_(value)
    state = json.loads((path / "state.json").read_text())
    _restore_optimizer(optimizer, load_file(str(path / "optimizer.safetensors")), state.pop("optimizer"))
    rng = load_file(str(path / "rng.safetensors"))
    return Checkpoint(step=int(state["step"]), state=state, path=path), rng
