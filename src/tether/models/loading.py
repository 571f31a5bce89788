"""Where a run's base model comes from, offline, and what identifies it.

``load_base`` reads ``default`` (the embedded SmolLM2), ``tiny`` (a random 2-layer model), a local
Hugging Face directory or a hub id already in the local cache (``hub_snapshot``, which data files
use too). Nothing is downloaded: hub ids resolve through ``snapshot_download(local_files_only=True)``
and every ``from_pretrained`` passes ``local_files_only=True``, so an uncached id fails with one
sentence saying how to fetch it. Weights are read from safetensors only: a directory whose weights
are pickles is refused by name before anything loads (``check_not_pickled``). ``fingerprint`` and
``adapter_digest`` identify the weights and tokenizer as loaded, so a checkpoint refuses another
base of the same shapes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tether.models.default_model import load_default_model
from tether.models.tiny import byte_tokenizer, tiny_causal_lm


def hub_snapshot(spec: str, argument: str, *, expected: str, repo_type: str = "model") -> Path:
    """The local Hugging Face cache's snapshot of hub id ``spec`` (a ``repo_type`` repository); tether
    never downloads, so an uncached id gets one sentence saying how to fetch it once."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(spec, repo_type=repo_type, local_files_only=True))
    except HFValidationError as exc:
        raise ValueError(f"{argument}: expected {expected}, got {spec!r}, which is neither a local path nor a valid "
                         "hub id; check the spelling.") from exc
    except LocalEntryNotFoundError as exc:
        fetch = f"hf download {spec}" + (f" --repo-type {repo_type}" if repo_type != "model" else "")
        raise ValueError(
            f"{argument}: {spec!r} is no local path and is not in the Hugging Face cache ({constants.HF_HUB_CACHE}); "
            f"tether never downloads. Fetch it once with `{fetch}` (or set HF_HUB_CACHE to the cache that holds "
            "it), or pass a local path."
        ) from exc



_KINDS = "'default', 'tiny', a local model directory or a hub id in the local Hugging Face cache"


def _looks_like_path(spec: str) -> bool:
    # A hub id is "name" or "owner/name"; anything else the user typed is meant as a path.
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec


def model_directory(spec: str) -> Path:
    """The local directory holding ``spec``: the directory itself, or its cached hub snapshot."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if _looks_like_path(spec):
        raise ValueError(f"model: expected {_KINDS}, got {spec!r}: no such directory; check the path.")
    return hub_snapshot(spec, "model", expected=_KINDS)


def check_not_pickled(directory: Path, argument: str, *, weights: str = "model") -> None:
    """Refuse ``directory`` when its ``weights`` (``model`` or ``adapter_model``) exist only as pickles.

    Loading a pickle can run code, and transformers and PEFT fall back to one when no
    safetensors file is there; tether never reads them (its own checkpoints pickle nothing)."""
    safe = f"{weights}*.safetensors"
    pickled = "pytorch_model*.bin" if weights == "model" else f"{weights}*.bin"
    found = sorted(directory.glob(pickled))
    if found and not any(directory.glob(safe)):
        raise ValueError(
            f"{argument}: expected safetensors weights ({safe}) in {directory}, got only the pickle {found[0]}; "
            "tether refuses pickled weights, since loading one can run code. Convert it once where you trust "
            "the file (load it with transformers or PEFT and save_pretrained, which writes safetensors), or "
            "pass a directory with safetensors weights."
        )


def load_base(spec: str, seed: int, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any]:
    """``(model in eval mode, tokenizer)`` for ``spec`` (see the module docstring), in ``dtype``."""
    if spec == "default":
        return load_default_model(dtype=dtype)
    if spec == "tiny":
        tokenizer = byte_tokenizer()
        return tiny_causal_lm(tokenizer, hidden=64, layers=2, seed=seed, head_scale=1.0, dtype=dtype), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_directory(spec)
    check_not_pickled(path, "model")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, use_safetensors=True)
    return model.eval(), tokenizer


def load_adapter(base: nn.Module, path: str) -> nn.Module:
    """``base`` wrapped by PEFT with the LoRA adapter saved in ``path``, its weights trainable."""
    import peft

    directory = Path(path).expanduser()
    if not (directory / "adapter_config.json").is_file():
        raise ValueError(f"adapter: expected a directory holding a PEFT adapter (adapter_config.json), got "
                         f"{path!r}; pass the directory that save_pretrained wrote.")
    check_not_pickled(directory, "adapter", weights="adapter_model")
    config = peft.PeftConfig.from_pretrained(directory)
    if config.peft_type != peft.PeftType.LORA:
        raise ValueError(f"adapter: {path!r} holds a {config.peft_type.value} adapter; tether continues LoRA "
                         "adapters only.")
    # The adapter keeps PEFT's float32 factors over a bfloat16 base (autocast_adapter_dtype).
    return peft.PeftModel.from_pretrained(base, directory, is_trainable=True)


def adapter_digest(policy: nn.Module) -> str:
    """SHA-256 of the adapter's trainable tensors as loaded (names, shapes and values)."""
    digest = hashlib.sha256()
    for name, param in policy.named_parameters():
        if param.requires_grad:
            digest.update(f"{name}:{list(param.shape)};".encode())
            digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


# ``fingerprint`` hashes every tensor's name, shape, dtype and an evenly strided sample of at most
# ``_SAMPLE`` of its values (all of them for small tensors): two bases that differ at all differ in far
# more places than that sample misses, and hashing 135M weights in full would add seconds to every
# start. A continued adapter adds the digest of its weights as loaded.
_SAMPLE = 1 << 16
_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(model: nn.Module, tokenizer: Any) -> dict[str, str]:
    """SHA-256 digests of the base weights (strided sample) and of the tokenizer's vocabulary."""
    weights = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        # Raw bits as integers of the same width (numpy has no bfloat16); numpy's strided
        # copy is far faster than torch's here.
        bits = tensor.detach().cpu().reshape(-1).view(_SAME_WIDTH[tensor.element_size()]).numpy()
        weights.update(f"{name}:{list(tensor.shape)}:{tensor.dtype};".encode())
        weights.update(bits[:: max(1, bits.size // _SAMPLE)].tobytes())
    vocab = {"vocab": sorted(tokenizer.get_vocab().items()), "special": str(tokenizer.special_tokens_map),
             "chat_template": str(getattr(tokenizer, "chat_template", None))}
    text = json.dumps(vocab, sort_keys=True).encode()
    return {"weights": weights.hexdigest(), "tokenizer": hashlib.sha256(text).hexdigest()}
