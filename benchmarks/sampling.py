"""Sampling side by side: tether's sampler, Hugging Face ``generate`` and llama.cpp, tokens/s.

The embedded SmolLM2-135M-Instruct on the default task's chat prompts (``arithmetic``,
training stream of seed 0, rendered with the chat template), left-padded where an engine
needs it. Every row samples exactly ``--new-tokens`` tokens (no end-of-sequence stop) at
the default config's temperature with no top-k/top-p, on ``--threads`` threads. Engines:
``tether`` (``sample_responses`` on the float32 model), ``hf-generate`` (``model.generate``
on the same model, ``min_new_tokens`` forcing the length) and llama.cpp F16 and Q8_0
(``llama-cpp-python``'s C API: GGUFs requantized from the package's Q4_1 file, i.e. the
weights tether runs in float32; one context with a KV stream per sequence, the prompts
prefilled in one ``llama_decode``, a repeated prompt once and copied with
``llama_memory_seq_cp``, then one ``llama_decode`` of one token per sequence a step, each
row drawn by its own temp + dist sampler chain). Timed: prefill + decode + sampling, not
model loading. Each engine x batch runs in a fresh process, 1 warm-up, median of 3.
tokens/s = rows x new tokens / wall seconds. Goal (issue 29): tether >= 2x HF generate and
within 2x of llama.cpp F16 at batch 72. A full run records each engine x batch in
``results/sampling.jsonl`` (``--results``; ``--quick`` only when given); ``table`` reads them.

    .venv-bench/bin/python benchmarks/sampling.py            # full table (about 6 min)
    .venv/bin/python benchmarks/sampling.py --quick          # smoke run; no llama_cpp: its rows say so
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _results  # noqa: E402
from _common import Measurement, child_error, markdown_table, measure_in_subprocess, verdict  # noqa: E402

ENGINES = ("tether", "hf-generate", "llama.cpp F16", "llama.cpp Q8_0")
LLAMA_FTYPES = {"llama.cpp F16": "F16", "llama.cpp Q8_0": "Q8_0"}
# (distinct prompts, rows per prompt): batch 1, 8, 16, 72 of distinct prompts, and the
# default training step's 12 prompts x 6 answers.
FULL_LAYOUTS = ((1, 1), (8, 1), (16, 1), (72, 1), (12, 6))
QUICK_LAYOUTS = ((1, 1), (2, 1), (1, 2))
FULL_NEW_TOKENS, QUICK_NEW_TOKENS = 20, 3
GOALS = {"hf-generate": 2.0, "llama.cpp F16": 0.5}  # tether / peer at batch 72 of distinct prompts (issue 29)
GOAL_LAYOUT = (72, 1)
ROW_KEY = ("run", "engine", "prompts", "group")  # a row of sampling.jsonl replaces the one equal on these
COMMAND = ".venv-bench/bin/python benchmarks/sampling.py"


def layout_label(prompts: int, group: int) -> str:
    return str(prompts) if group == 1 else f"{prompts * group} = {prompts} prompt{'s' * (prompts > 1)} × {group}"


# ---------------------------------------------------------------------------------------
# Child side: one engine on one batch. No torch import at module level, so that llama.cpp's
# processes load only llama.cpp's OpenMP runtime.


def setup_engine(engine, prompts, group, new_tokens, temperature, threads, pad_id, seed, gguf_source=""):
    """Build ``engine`` for ``prompts`` (token id lists) each repeated ``group`` times; return
    the zero-argument callable that samples the batch once."""
    if engine in LLAMA_FTYPES:
        return _llama_engine(LLAMA_FTYPES[engine], gguf_source, prompts, group, new_tokens, temperature,
                             threads, seed)
    import torch

    from tether.models.default_model import load_default_model
    from tether.models.sampling import sample_responses

    torch.set_num_threads(threads)
    model, _ = load_default_model()
    model.eval()
    rows = [p for p in prompts for _ in range(group)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    generator = torch.Generator().manual_seed(seed)
    if engine == "tether":

        def run():
            out = sample_responses(model, ids, mask, max_new_tokens=new_tokens, eos_ids=set(), pad_id=pad_id,
                                   temperature=temperature, generator=generator)
            assert tuple(out.tokens.shape) == (len(rows), new_tokens)

        return run
    if engine != "hf-generate":
        raise ValueError(f"unknown engine {engine!r}")
    torch.manual_seed(seed)

    def run():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True, temperature=temperature,
                                 top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=pad_id)
        assert tuple(out.shape) == (len(rows), width + new_tokens)

    return run


def llama_gguf(ftype: str, source: str) -> Path:
    """``source`` (the package's Q4_1 GGUF) requantized to ``ftype``, cached outside the repo."""
    import llama_cpp

    from_path = Path(source)
    stat = from_path.stat()
    cache = Path(tempfile.gettempdir()) / "tether-sampling-bench"
    target = cache / f"{from_path.stem}-{stat.st_size}-{int(stat.st_mtime)}.{ftype}.gguf"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[ftype]
    params.allow_requantize = True
    partial = target.with_suffix(f".{os.getpid()}.part")
    if llama_cpp.llama_model_quantize(str(from_path).encode(), str(partial).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize of {from_path} to {ftype} failed")
    partial.replace(target)
    return target


_LOG_SINK = None  # llama.cpp keeps the callback's pointer: keep the object alive


def _quiet_llama(llama_cpp) -> None:
    global _LOG_SINK
    _LOG_SINK = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_log_set(_LOG_SINK, ctypes.c_void_p())


def _llama_model(L, ftype, gguf_source):
    """The GGUF of ``ftype`` loaded by llama.cpp (its backend started, its log silenced)."""
    _quiet_llama(L)
    path = llama_gguf(ftype, gguf_source)
    L.llama_backend_init()
    model_params = L.llama_model_default_params()
    # Q8_0 weights go to the AMX (or CPU repack) buffer by default, whose matmul segfaults on
    # this build and CPU (ggml-org/llama.cpp#20824): plain ggml CPU kernels for Q8_0.
    model_params.use_extra_bufts = ftype != "Q8_0"
    model = L.llama_model_load_from_file(str(path).encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    return model


def _llama_context(L, model, rows: int, prefill: int, n_ctx: int, threads: int):
    """A context of ``rows`` sequences, each with its own KV stream, batches up to the prefill."""
    params = L.llama_context_default_params()
    params.n_seq_max = rows
    params.kv_unified = False  # a KV stream per sequence: each attends to its own tokens only
    params.n_ctx = n_ctx
    params.n_batch = params.n_ubatch = max(prefill, rows)
    params.n_threads = params.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not create a context for {rows} sequences")
    return ctx


def _llama_engine(ftype, gguf_source, prompts, group, new_tokens, temperature, threads, seed):
    import llama_cpp as L

    model = _llama_model(L, ftype, gguf_source)
    rows, prefill = len(prompts) * group, sum(len(p) for p in prompts)
    ctx = _llama_context(L, model, rows, prefill, rows * (max(len(p) for p in prompts) + new_tokens + 1), threads)
    memory = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(max(prefill, rows), 0, 1)
    samplers = []
    for row in range(rows):
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(temperature))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed + row))
        samplers.append(chain)

    def put(i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, logits

    def run():
        L.llama_memory_clear(memory, True)
        n, last = 0, []  # last: each row's batch index of the logits it samples from
        for p, ids in enumerate(prompts):  # each distinct prompt once, into its group's first row
            for j, token in enumerate(ids):
                put(n, token, j, p * group, j == len(ids) - 1)
                n += 1
            last += [n - 1] * group
        batch.n_tokens = n
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed on the prefill")
        for p in range(len(prompts)):
            for g in range(1, group):
                L.llama_memory_seq_cp(memory, p * group, p * group + g, -1, -1)
        pos = [len(prompts[row // group]) for row in range(rows)]
        for step in range(new_tokens):
            tokens = [L.llama_sampler_sample(samplers[row], ctx, last[row]) for row in range(rows)]
            if step + 1 == new_tokens:
                break
            for row, token in enumerate(tokens):
                put(row, token, pos[row] + step, row, True)
            batch.n_tokens = rows
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError(f"llama_decode failed at decode step {step}")
            last = list(range(rows))

    return run


# ---------------------------------------------------------------------------------------
# Parent side.


def chat_prompts(count: int) -> tuple[list[list[int]], int, str]:
    """Token ids of the default task's first ``count`` training prompts, the pad id and the
    GGUF file the embedded model comes from."""
    from tether.models.chat import render_chat_ids
    from tether.models.default_model import load_default_model, locate_gguf, model_info
    from tether.train.config import TrainConfig
    from tether.train.tasks import load_task

    cfg = TrainConfig()
    info = model_info()
    if info.cached:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(info.cache_dir, local_files_only=True)
    else:
        tokenizer = load_default_model()[1]
    task = load_task(cfg.task)
    prompts = [render_chat_ids(tokenizer, task.train_problem(cfg.seed, i, set()).chat, add_generation_prompt=True)
               for i in range(count)]
    return prompts, int(tokenizer.pad_token_id), str(locate_gguf())


def llama_version(python: str) -> str | None:
    """llama_cpp's version under ``python``; None where it does not import there."""
    probe = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                           text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def measured_row(engine: str, prompts: int, group: int, new_tokens: int, m: Measurement) -> dict:
    """The figures of one engine x layout from its measurement: rows x new tokens / median wall s."""
    return {"engine": engine, "prompts": prompts, "group": group, "batch": prompts * group, "median_s": m.median_s,
            "times_s": list(m.times_s), "cpu_median_s": m.cpu_median_s,
            "tokens_per_s": prompts * group * new_tokens / m.median_s}


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    if "tokens_per_s" in row:
        return f"{row['tokens_per_s']:,.1f}"
    return "not installed" if "skipped" in row else "failed"


def _ratio(layout: tuple[int, int], cells: dict[str, dict], peer: str) -> str:
    a, b = cells.get("tether", {}).get("tokens_per_s"), cells.get(peer, {}).get("tokens_per_s")
    if a is None or b is None:
        return ""
    goal = GOALS[peer] if layout == GOAL_LAYOUT else None
    return f"{a / b:.2f}x" + ("" if goal is None else f", {verdict(a / b, goal, higher_is_better=True)}")


def speed_table(rows: list[dict]) -> str:
    """tokens/s a layout (rows in measuring order), an engine a column, tether / HF generate and
    tether / llama.cpp F16 where both ran, with the goal's verdict at batch 72."""
    engines = [e for e in ENGINES if any(r["engine"] == e for r in rows)]
    layouts: dict[tuple[int, int], dict[str, dict]] = {}
    for r in rows:
        layouts.setdefault((r["prompts"], r["group"]), {})[r["engine"]] = r
    peers = [p for p in GOALS if "tether" in engines and p in engines]
    headers = ["batch", *(f"{e} (tokens/s)" for e in engines), *(f"tether / {p}" for p in peers)]
    lines = [[layout_label(*layout), *(_cell(cells.get(e)) for e in engines),
              *(_ratio(layout, cells, p) for p in peers)] for layout, cells in layouts.items()]
    return markdown_table(headers, lines)


def detail_table(rows: list[dict]) -> str:
    """Each measured row's median, every timed run and the median CPU seconds."""
    lines = [[layout_label(r["prompts"], r["group"]), r["engine"], f"{r['median_s']:.3f}",
              ", ".join(f"{t:.3f}" for t in r["times_s"]), f"{r['cpu_median_s']:.3f}"] for r in rows if "median_s" in r]
    return markdown_table(["batch", "engine", "median s", "each run (s)", "CPU s (median)"], lines)


def table(records: list[dict]) -> str:
    """The docs' table: the newest full run's tokens/s and ratios, and where and how it ran."""
    rows = _results.newest_run(records)
    if not rows:
        return f"No full run is recorded yet: `{COMMAND}` records one in `benchmarks/results/sampling.jsonl`."
    r = rows[0]
    versions = ", ".join(f"{k} {r[k]}" for k in ("torch", "transformers", "llama_cpp") if r.get(k))
    return (speed_table(rows) + f"\n\nRun {r['run']}: {r['machine']}, commit {r['commit']}, {r['date']}; "
            f"{r['threads']} threads, {r['new_tokens']} new tokens a row at temperature {r['temperature']:g}, "
            f"median of {r['repeats']} after {r['warmup']} warm-up; {versions}; `{r['command']}`.")


def parse_args(argv=None) -> argparse.Namespace:
    from tether.train.config import TrainConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batches 1, 2 and 1 prompt x 2, 3 new tokens")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help=f"tokens sampled per row (default {FULL_NEW_TOKENS})")
    parser.add_argument("--temperature", type=float, default=TrainConfig().temperature,
                        help="sampling temperature (default: the training config's)")
    parser.add_argument("--threads", type=int, default=2, help="threads of every engine")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine and batch")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per engine and batch")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ", ".join(ENGINES))
    parser.add_argument("--llama-python", default=sys.executable,
                        help="the interpreter of the llama.cpp rows (one where llama_cpp imports)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a variant's process is killed")
    parser.add_argument("--results", type=Path, default=None,
                        help=f"write sampling.jsonl here (default {_results.RESULTS}; a --quick run only when given)")
    args = parser.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        parser.error(f"--engines: unknown {unknown}; choose from {list(ENGINES)}")
    args.results = _results.destination(args.results, args.quick)
    return args


def measure_rows(args, layouts, new_tokens, prompts, pad_id, gguf, llama: str | None) -> list[dict]:
    """One row an engine x layout: its figures, ``skipped`` where llama_cpp does not import, or
    ``error`` where the engine's process failed."""
    rows = []
    for n_prompts, group in layouts:
        for engine in args.engines:
            on_llama = engine in LLAMA_FTYPES
            row = {"engine": engine, "prompts": n_prompts, "group": group, "batch": n_prompts * group}
            if on_llama and llama is None:
                rows.append({**row, "skipped": f"llama_cpp does not import in {args.llama_python}"})
                continue
            kwargs = dict(engine=engine, prompts=prompts[:n_prompts], group=group, new_tokens=new_tokens,
                          temperature=args.temperature, threads=args.threads, pad_id=pad_id, seed=0, gguf_source=gguf)
            try:
                m = measure_in_subprocess(__file__, "setup_engine", kwargs, repeats=args.repeats, warmup=args.warmup,
                                          timeout_s=args.timeout, python=args.llama_python if on_llama else None)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                rows.append({**row, "error": child_error(error)})
                print(f"  {layout_label(n_prompts, group)}, {engine}: failed", file=sys.stderr, flush=True)
                continue
            rows.append(measured_row(engine, n_prompts, group, new_tokens, m))
            print(f"  {layout_label(n_prompts, group)}, {engine}: {m.median_s:.3f} s", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    layouts = QUICK_LAYOUTS if args.quick else FULL_LAYOUTS
    new_tokens = args.new_tokens or (QUICK_NEW_TOKENS if args.quick else FULL_NEW_TOKENS)
    prompts, pad_id, gguf = chat_prompts(max(p for p, _ in layouts))
    llama = llama_version(args.llama_python) if any(e in LLAMA_FTYPES for e in args.engines) else None
    run = _results.run_id()
    print(f"sampling {new_tokens} tokens a row, temperature {args.temperature}, no top-k/top-p, no eos stop; "
          f"{args.threads} threads; prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens; "
          f"median of {args.repeats} after {args.warmup} warm-up, each engine x batch in a fresh process\n")
    rows = measure_rows(args, layouts, new_tokens, prompts, pad_id, gguf, llama)
    print(speed_table(rows))
    print()
    print(detail_table(rows))
    if args.results is None:
        return rows
    workload = {"run": run, "quick": args.quick, "model": Path(gguf).name, "new_tokens": new_tokens,
                "temperature": args.temperature, "threads": args.threads, "repeats": args.repeats,
                "warmup": args.warmup, "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
                "torch": _results.version("torch"), "transformers": _results.version("transformers"),
                "llama_cpp": llama,
                "command": _results.command(__file__, argv), **_results.stamp()}
    for row in rows:
        _results.write("sampling", {**workload, **row}, ROW_KEY, root=args.results)
    print(f"\n{len(rows)} records in {Path(args.results) / 'sampling.jsonl'}")
    return rows


if __name__ == "__main__":
    main()
