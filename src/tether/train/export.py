"""``tether export RUN OUT [--merge] [--best]``: a run's policy as a Hugging Face directory.

The policy is rebuilt from ``RUN/config.yaml`` and the newest intact checkpoint is loaded
into it (``--best``: the best periodic evaluation's, ``RUN/best/``) with the same checks as a
resume, the base-model fingerprint included, so an adapter is never written over a base it
was not trained on. What ``OUT`` holds:

* LoRA run, no ``--merge``: the adapter (``adapter_config.json``,
  ``adapter_model.safetensors``), for ``peft.PeftModel.from_pretrained(base, OUT)`` with the
  base the run trained (``base_model_name_or_path`` names it when it is a directory);
* LoRA run with ``--merge``, or a full fine-tune: the whole model (``config.json``,
  ``model.safetensors``, ``generation_config.json``) for
  ``transformers.AutoModelForCausalLM.from_pretrained(OUT)``. The embedded default model is
  loaded from GGUF but its weights are dense, so this is an ordinary float directory;

and always the tokenizer files with the chat template, and ``tether_export.json`` (run name,
checkpoint, step, kind, base). Files get the umask's mode; ``OUT`` is written beside and renamed
into place. ``--push-to-hub REPO`` adds a model card (``README.md``: config, summary figures,
leash settings, plots in ``figures/``) and uploads ``OUT``; a failed upload leaves it complete.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tether.train.checkpoint import open_checkpoint
from tether.train.run_dir import RESUMABLE_KEYS, best_root, read_run_config
from tether.train.plots import plot_metrics
from tether.train.run import build_models

EXPORT_RECORD = "tether_export.json"


@dataclass
class ExportResult:
    """What was written: the directory, its kind (``adapter``, ``merged`` or ``full``) and the step."""

    out: Path
    kind: str
    step: int
    checkpoint: Path
    pushed: str = ""  # the repo's URL after --push-to-hub


def _check_out(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        what = "a file" if not out.is_dir() else "a directory that is not empty"
        raise ValueError(f"OUT: {out} is {what}; export writes a new directory. Choose another OUT or remove it.")


def _save_model(policy: Any, lora: bool, merge: bool, target: Path) -> str:
    if lora and not merge:
        policy.save_pretrained(str(target), safe_serialization=True)
        return "adapter"
    model = policy.merge_and_unload() if lora else policy
    model.save_pretrained(str(target), safe_serialization=True)
    return "merged" if lora else "full"


def _shareable_modes(directory: Path) -> None:
    """Give every file under ``directory`` the mode the umask gives a new file (0644 under 022)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def export_run(run_dir: str | Path, out: str | Path, *, merge: bool = False, best: bool = False,
               push_to_hub: str = "") -> ExportResult:
    """Write the policy of ``run_dir``'s newest intact (or best) checkpoint to ``out``; with
    ``push_to_hub``, a model card too, and upload ``out`` to that Hub repo."""
    run_dir, out = Path(run_dir), Path(out)
    _check_out(out)
    cfg = read_run_config(run_dir)
    root = best_root(run_dir, required=True) if best else None
    models = build_models(cfg)
    trainable = [p for p in models.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable)  # receives the checkpoint's optimizer state; then dropped
    ckpt, _ = open_checkpoint(cfg, models, optimizer, allowed=(*RESUMABLE_KEYS, "eval_size"), root=root)
    tmp = out.with_name(f".{out.name}.tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        kind = _save_model(models.policy, cfg.lora_rank > 0, merge, tmp)
        models.tokenizer.save_pretrained(str(tmp))
        # Names, not absolute paths: the directory is meant to be copied and shared.
        record = {"run": run_dir.resolve().name, "checkpoint": os.path.relpath(ckpt.path, run_dir),
                  "step": ckpt.step, "kind": kind, "base": ckpt.state["base"]}
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=1))
        if push_to_hub:
            write_model_card(tmp, run_dir, cfg, record, push_to_hub)
        _shareable_modes(tmp)
        if out.is_dir():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = ExportResult(out=out, kind=kind, step=ckpt.step, checkpoint=ckpt.path)
    if push_to_hub:
        result.pushed = push_folder(out, push_to_hub, f"tether export of {record['run']}, step {ckpt.step}")
    return result


def write_model_card(folder: Path, run_dir: Path, cfg: Any, record: dict[str, Any], repo: str) -> None:
    """``folder/README.md``: Hub metadata, the run's figures and leash, its config; plots in ``figures/``."""
    import yaml

    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    figures = folder / "figures"
    figures.mkdir()
    shown = []
    if (run_dir / "metrics.jsonl").is_file():
        for path in plot_metrics(run_dir):
            if path.stem in ("overview", "kl_per_seq"):
                shutil.copy(path, figures / path.name)
                shown.append(path.name)
    base = record["base"] if isinstance(record["base"], str) else cfg.model
    meta = {"library_name": "peft" if record["kind"] == "adapter" else "transformers",
            "tags": ["tether", "grpo", "reinforcement-learning"], "base_model": base}
    leash = {key: getattr(cfg, key) for key in ("kl_controller", "kl_target", "kl_coef", "kl_mode", "kl_bound")}
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "", f"# {repo.split('/')[-1]}", "",
             f"A {record['kind']} policy trained by tether's GRPO on a KL leash to its "
             f"reference: run `{record['run']}`, step {record['step']}, base `{base}`, task `{cfg.task}`.", "",
             "## Results (`summary.json`)", "", "| figure | value | unit |", "|---|---|---|"]
    units = summary.pop("units", {})
    lines += [f"| `{key}` | {f'{value:.4g}' if isinstance(value, float) else value} | {units.get(key, '')} |"
              for key, value in summary.items()]
    lines += ["", "## The leash", "", "| setting | value |", "|---|---|"]
    lines += [f"| `{key}` | {value} |" for key, value in leash.items()]
    lines += ["", *[f"![{name}](figures/{name})" for name in shown], "", "## Config", "", "```yaml",
              cfg.to_yaml().strip(), "```", ""]
    (folder / "README.md").write_text("\n".join(lines))


def push_folder(folder: Path, repo: str, message: str) -> str:
    """Upload ``folder`` to the Hub model repo ``repo`` (created if absent); its URL."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo, repo_type="model", exist_ok=True)
        return str(api.upload_folder(repo_id=repo, folder_path=str(folder), commit_message=message).repo_url)
    except Exception as exc:  # no token, no network, no permission: huggingface_hub and httpx types
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise OSError(f"push-to-hub: {folder} is written, but uploading it to {repo} failed ({type(exc).__name__}: "
                      f"{reason}); with a token (`hf auth login`) and network, push it later with "
                      f"`hf upload {repo} {folder} .`") from exc
