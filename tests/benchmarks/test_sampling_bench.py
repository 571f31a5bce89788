"""``benchmarks/sampling.py``: its torch engines sample the asked shape, and without llama_cpp its
llama.cpp rows say "not installed" instead of failing."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from sampling import chat_prompts, layout_label, main, setup_engine  # noqa: E402


def test_torch_engines_sample_every_row_in_full():
    """One prompt twice, 2 new tokens each; the callables assert their output's shape."""
    prompts, pad_id, gguf = chat_prompts(1)
    assert prompts[0] and gguf.endswith(".gguf")
    for engine in ("tether", "hf-generate"):
        run = setup_engine(engine, prompts, 2, 2, 1.0, 1, pad_id, 0, gguf)
        run()


def test_llama_rows_without_llama_cpp(capsys):
    main(["--quick", "--engines", "llama.cpp F16,llama.cpp Q8_0", "--llama-python", "/bin/false"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[0] == "| batch | llama.cpp F16 (tokens/s) | llama.cpp Q8_0 (tokens/s) |"
    assert table[1:4] == [f"| {label} | not installed | not installed |" for label in ("1", "2", layout_label(1, 2))]
