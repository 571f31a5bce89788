"""benchmarks/gpu_check.py off the GPU: its CPU dry run end to end (so the script cannot rot), the
model wheel's split and join, the CUDA test selection, and the random Llama's size."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_stages  # noqa: E402
import gpu_wheels  # noqa: E402
import random_llama  # noqa: E402
from _cuda_tests import marked_files, needs_gpu  # noqa: E402


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# ------------------------------------------------------------------------------ the dry run
@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-out")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "OUT": str(out)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run",
                           "--work", str(tmp_path_factory.mktemp("work"))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    report = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").is_file() else None
    return proc, report, out


def test_dry_run_exits_cleanly_and_records_every_stage(dry_run):
    proc, report, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["schema"] == gpu_check.SCHEMA and report["dry_run"] is True
    assert list(report["stages"]) == [s.name for s in gpu_check.STAGES]
    assert all(r["status"] in gpu_check.STATUSES for r in report["stages"].values())
    assert report["device"]["cuda_available"] is False and report["packages"]["torch"]
    log = (out / "gpu_check.log").read_text()
    for name in ("cuda-tests", "parity", "nccl", "train", "bench-llama-1b", "frontier", "largest-model"):
        assert f"=== {name}: " in log


def test_dry_run_skips_what_needs_cuda_and_says_why(dry_run):
    stages = dry_run[1]["stages"]
    assert stages["install"]["status"] == "skipped" and "dry run" in stages["install"]["reason"]
    assert stages["bench-default"]["status"] == "skipped_no_cuda" and "CUDA" in stages["bench-default"]["reason"]
    tests = stages["cuda-tests"]
    assert tests["status"] == "skipped_no_cuda"
    counts = tests["figures"]
    # test_cuda_path's 2, test_models_devices' float32 and bfloat16 step, the flash-attn packing test
    assert counts["tests"] >= 5 and counts["skipped"] == counts["tests"] and counts["passed"] == 0
    assert "tests/train/test_cuda_path.py" in counts["files"]
    assert all("CUDA" in line for line in counts["skipped_tests"])


def test_dry_run_parity_nccl_and_train_ran_on_the_cpu(dry_run):
    stages = dry_run[1]["stages"]
    parity = stages["parity"]
    assert parity["status"] == "ran" and parity["device"] == "cpu"
    f = parity["figures"]
    assert f["tokens_scored"] > 100 and f["kl_per_token_float64"] > 0
    assert all(_finite(v) for v in f["bf16_vs_float64"].values())
    assert f["within_tolerance"] is True and f["tolerance"] == gpu_stages.PARITY_TOLERANCE
    assert f["bf16_vs_float64"]["logprob_max_abs"] > 0  # bf16 rounding shows: the comparison is not vacuous

    nccl = stages["nccl"]["figures"]
    assert stages["nccl"]["status"] == "ran" and nccl["backend"] == "gloo" and nccl["world_size"] == 1
    assert nccl["all_reduce_ok"] and nccl["matches_unsharded"] and nccl["fsdp_units"] >= 2
    assert nccl["parameters_compared"] == nccl["parameters_total"] > 0

    train = stages["train"]["figures"]
    assert stages["train"]["status"] == "ran" and train["model"] == "tiny" and train["steps"] == 2
    for key in ("wall_s", "median_step_s", "median_tokens_per_s_per_gpu", "accuracy_before", "accuracy_after",
                "eval_kl_per_seq"):
        assert _finite(train[key]), key
    assert train["median_tokens_per_s_per_gpu"] > 0


def test_dry_run_frontier_writes_its_records_under_out(dry_run):
    """The quick frontier (tiny model): constant-0.1, base and best-of-n 1, 2, 4 at seed 0, five
    records with the SPEC keys in $OUT/frontier/frontier.jsonl, nothing left for a later call."""
    _, report, out = dry_run
    stage = report["stages"]["frontier"]
    assert stage["status"] == "ran", stage
    figures = stage["figures"]
    assert figures["new_records"] == 5 and "0 jobs left" in figures["summary"]
    records = [json.loads(line) for line in (out / "frontier" / "frontier.jsonl").read_text().splitlines()]
    quick = [r for r in records if r["mode"] == "quick"]
    assert sorted(r["point"] for r in quick) == ["base", "best-of-n-1", "best-of-n-2", "best-of-n-4", "constant-0.1"]
    assert all(len(r["per_problem"]) == r["eval_size"] for r in quick)
    assert report["headline"]["frontier"]["new_records"] == 5


def test_dry_run_bench_reports_nemo_rl_tokens_and_generation_share(dry_run):
    bench = dry_run[1]["stages"]["bench-llama-1b"]
    assert bench["status"] == "ran"
    f = bench["figures"]
    assert f["model"] == "llama-tiny" and f["gpus"] == 1
    row = f["rows"]["tether/LoRA"]
    # all tokens of the step / step time / GPUs
    assert row["tokens_per_s_per_gpu"] == pytest.approx(row["tokens_per_step"] / row["median_step_s"] / f["gpus"])
    assert 0 < row["generation_share"] < 1 and row["mean_completion_tokens"] == f["max_new_tokens"]
    assert row["peak_gpu_memory_bytes"] is None  # no GPU: no figure is made up
    # the row of benchmarks/results/gpu_grpo.jsonl (SPEC section 13), with the loss pass split
    rows = [json.loads(line) for line in (dry_run[2] / "results" / "gpu_grpo.jsonl").read_text().splitlines()]
    (spec,) = [r for r in rows if (r["bench"], r["model"], r["mode"], r["tool"]) == ("step", "llama-tiny", "lora",
                                                                                      "tether")]
    assert (spec["model"], spec["mode"], spec["tool"], spec["device"]) == ("llama-tiny", "lora", "tether", "CPU")
    assert spec["tokens_per_s"] == row["tokens_per_s_per_gpu"] and spec["peak_gpu_memory_bytes"] is None
    assert spec["run"].endswith("-llama-tiny") and spec["date"] and spec["commit"]
    phases = spec["phases_s"]
    assert phases["loss_forward"] + phases["loss_backward"] == pytest.approx(phases["loss"])
    assert 0 < phases["loss_forward"] < phases["loss"] and phases["readings"] > 0
    headline = dry_run[1]["headline"]
    assert headline["bench-llama-1b"]["rows"]["tether/LoRA"]["tokens_per_s_per_gpu"] == row["tokens_per_s_per_gpu"]


def test_dry_run_largest_model_stops_each_ladder_at_the_first_size_that_runs_out_of_memory(dry_run):
    """The dry run climbs tiny, tiny-wide, 1b4 under a cap of DRY_RUN_CAP_MIB per attempt. tiny's
    full step holds about 5 copies of 3.2e6 float32 parameters (weights, reference, gradient, two
    Adam moments: 64 MB) and fits; tiny-wide's weights alone are 1.1e8 x 4 bytes = 444 MB > 200 MiB,
    so loading them fails in the allocator (a real failure, not a simulated one): a row with
    fits false and the error line, and 1b4 is never tried (nor built)."""
    _, report, out = dry_run
    stage = report["stages"]["largest-model"]
    assert stage["status"] == "ran", stage
    rows = [json.loads(line) for line in (out / "results" / "gpu_grpo.jsonl").read_text().splitlines()]
    largest = [r for r in rows if r["bench"] == "largest-model"]
    for mode in ("full", "lora"):
        ladder = {r["size"]: r for r in largest if (r["tool"], r["mode"]) == ("tether", mode)}
        assert sorted(ladder) == ["tiny", "tiny-wide"], mode  # stopped: no 1b4 row
        tiny, wide = ladder["tiny"], ladder["tiny-wide"]
        assert tiny["fits"] is True and tiny["error"] is None and tiny["tokens_per_s"] > 0
        assert tiny["model"] == "llama-tiny" and tiny["max_new_tokens"] == 4 and tiny["memory_cap_mib"] == 200
        assert wide["fits"] is False and wide["tokens_per_s"] is None
        assert "Cannot allocate memory" in wide["error"] or "can't allocate memory" in wide["error"]
        assert wide["parameters"] == random_llama.parameter_count(random_llama.SHAPES["tiny-wide"], 49152)
        assert tiny["run"] == wide["run"] and tiny["run"].endswith("-largest-model")
    assert stage["figures"]["largest"] == {"tether/full": "tiny", "tether/LoRA": "tiny"}
    assert report["headline"]["largest_model"] == {"tether/full": "tiny", "tether/LoRA": "tiny"}


def test_dry_run_records_each_stage_it_ran_for_the_repository(dry_run):
    """$OUT/results/gpu_check.jsonl: one record per stage that ran, with its status and figures."""
    _, report, out = dry_run
    records = [json.loads(line) for line in (out / "results" / "gpu_check.jsonl").read_text().splitlines()]
    ran = {name for name, r in report["stages"].items() if r["status"] in ("ran", "failed", "timeout")}
    assert {r["stage"] for r in records} == ran and {"parity", "nccl", "train"} <= ran
    by_stage = {r["stage"]: r for r in records}
    assert all(r["dry_run"] is True and r["device"] == "CPU" and r["started"] == report["started"] for r in records)
    assert by_stage["nccl"]["figures"]["matches_unsharded"] is True
    assert by_stage["train"]["figures"] == report["stages"]["train"]["figures"]


def test_the_dry_run_records_build_docs_gpu_check_table_once_taken_as_a_gpu_s(dry_run):
    """The records' figures carry every key gpu_tables reads: the same records, as if a GPU had
    written them, give a row per check stage that ran, with the train stage's own numbers."""
    import gpu_tables

    out = dry_run[2]
    records = [{**json.loads(line), "dry_run": False, "device": "GPU X"}
               for line in (out / "results" / "gpu_check.jsonl").read_text().splitlines()]
    table = gpu_tables.checks(records)
    train = next(r for r in records if r["stage"] == "train")["figures"]
    assert f"{train['wall_s']:.0f} s wall; held-out accuracy {100 * train['accuracy_before']:.1f} %" in table
    assert "| parity | ran | log-prob error mean" in table and "within tolerance: yes" in table
    assert "| nccl | ran | gloo, 1 rank(s)" in table and "| cuda-tests | not recorded |" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_gpu_run_without_cuda_is_refused_with_a_report(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path),
                           "--stash", str(tmp_path / "stash")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "no CUDA GPU" in report["error"] and report["stages"] == {}


def test_jobs_are_for_the_dry_run_only():
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--jobs", "2"])
    assert gpu_check.parse_args(["--dry-run"]).jobs == 3 and gpu_check.parse_args([]).jobs == 1


def test_the_estimator_stage_records_each_finished_run_in_out(tmp_path, monkeypatch):
    """bench-estimators runs estimators.py into $OUT/results; here its command on the CPU, shrunk to
    one quick run (the GPU's device and dtype swapped out), and the figures it reads back."""
    args = gpu_check.parse_args(["--dry-run", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                                 "--estimator-seeds", "5"])
    check = gpu_check.Check(args)
    real_sh = check.sh

    def on_the_cpu(tag, command, timeout_s, **env):
        swapped = [{"cuda": "cpu", "bfloat16": "float32"}.get(word, word) for word in command]
        return real_sh(tag, [*swapped, "--quick", "--variants", "k3-loss"], timeout_s, **env)

    monkeypatch.setattr(check, "sh", on_the_cpu)
    figures = gpu_stages.stage_bench_estimators(check, 200)
    assert figures["runs"] == 1 and figures["variants"] == ["k3-loss"]
    record = json.loads((tmp_path / "out" / "results" / "estimators.jsonl").read_text())
    assert record["seed"] == 5 and record["config"]["kl_correction"] == "none"


# ------------------------------------------------------------------------------ the model wheel's parts
def _wheel(tmp_path: Path, size: int) -> Path:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    wheel.write_bytes(random.Random(size).randbytes(size))
    return wheel


def test_split_then_join_restores_the_wheel_byte_for_byte(tmp_path):
    wheel = _wheel(tmp_path, 2_500_000)
    manifest = gpu_wheels.split_wheel(wheel, tmp_path / "model", part_mib=1.0)
    assert [p["name"] for p in manifest["parts"]] == ["part-0", "part-1", "part-2"]
    assert all(p["size"] <= 2**20 for p in manifest["parts"]) and sum(p["size"] for p in manifest["parts"]) == 2_500_000
    stash = tmp_path / "stash"
    assert gpu_wheels.stash_parts(tmp_path / "model", stash) == ["part-0", "part-1", "part-2"]
    joined, missing = gpu_wheels.join_parts(stash)
    assert missing == [] and joined.name == wheel.name and joined.read_bytes() == wheel.read_bytes()


def test_parts_carried_in_separate_calls_join_once_all_are_stashed(tmp_path):
    wheel = _wheel(tmp_path, 300_000)
    gpu_wheels.split_wheel(wheel, tmp_path / "built", part_mib=0.2)
    first, second, stash = tmp_path / "call-1", tmp_path / "call-2", tmp_path / "stash"
    for call, part in ((first, "part-0"), (second, "part-1")):
        call.mkdir()
        (call / "MANIFEST.json").write_bytes((tmp_path / "built" / "MANIFEST.json").read_bytes())
        (call / part).write_bytes((tmp_path / "built" / part).read_bytes())
    assert gpu_wheels.stash_parts(first, stash) == ["part-0"]
    assert gpu_wheels.join_parts(stash) == (None, ["part-1"])
    assert gpu_wheels.stash_parts(second, stash) == ["part-1"]
    joined, missing = gpu_wheels.join_parts(stash)
    assert missing == [] and joined.read_bytes() == wheel.read_bytes()


def test_a_damaged_part_is_refused(tmp_path):
    wheel = _wheel(tmp_path, 300_000)
    gpu_wheels.split_wheel(wheel, tmp_path / "model", part_mib=0.2)
    part = tmp_path / "model" / "part-1"
    data = part.read_bytes()
    part.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    with pytest.raises(gpu_wheels.PartsError, match="part-1: SHA-256 differs"):
        gpu_wheels.stash_parts(tmp_path / "model", tmp_path / "stash")


def test_split_refuses_a_size_that_is_not_positive(tmp_path):
    with pytest.raises(ValueError, match="part_mib"):
        gpu_wheels.split_wheel(_wheel(tmp_path, 10), tmp_path / "model", part_mib=0)


# ------------------------------------------------------------------------------ two calls on one machine
def _two_call_setup(tmp_path, monkeypatch, bench_least_s: float = 20.0):
    """gpu_check.run with CUDA faked, quick stand-in stages, and an install that stashes and joins
    the carried parts of a small fake wheel; returns ``(call, ran)``."""
    ran, model = [], {"ready": False}

    def install(check, timeout_s):
        gpu_wheels.stash_parts(check.wheels / "model", check.stash)
        wheel, missing = gpu_wheels.join_parts(check.stash)
        model["ready"] = wheel is not None
        return {"model_parts_missing": missing}

    def stage(name):
        return lambda check, timeout_s: ran.append(name) or {"value": 1.0}

    monkeypatch.setattr(gpu_check, "STAGES", (
        gpu_check.Stage("install", 60, install, needs_cuda=False),
        gpu_check.Stage("cuda-tests", 60, stage("cuda-tests")),
        gpu_check.Stage("train", 60, stage("train"), needs_model=True),
        gpu_check.Stage("bench-default", 60, stage("bench-default"), needs_model=True, least_s=bench_least_s),
    ))
    monkeypatch.setattr(gpu_check.Check, "model_ready", lambda self: model["ready"])
    monkeypatch.setattr(gpu_check, "device_facts", lambda cuda: {"cuda_available": cuda})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    built = tmp_path / "built"
    gpu_wheels.split_wheel(_wheel(tmp_path, 300_000), built, part_mib=0.2)

    def call(part: str, name: str, stash: str = "stash", budget_s: float = 520.0) -> tuple[int, dict]:
        model["ready"] = False  # each call is a new process
        wheels = tmp_path / name / "wheels"
        (wheels / "model").mkdir(parents=True)
        for file in ("MANIFEST.json", part):
            (wheels / "model" / file).write_bytes((built / file).read_bytes())
        out = tmp_path / name / "out"
        args = gpu_check.parse_args(["--out", str(out), "--wheels", str(wheels), "--stash", str(tmp_path / stash),
                                     "--work", str(tmp_path / name / "work"), "--budget-s", str(budget_s)])
        return gpu_check.run(args), json.loads((out / "gpu_check.json").read_text())

    return call, ran


def test_the_second_call_runs_the_model_stages_and_keeps_the_first_calls_records(tmp_path, monkeypatch):
    call, ran = _two_call_setup(tmp_path, monkeypatch)
    rc, first = call("part-0", "call-1")
    assert rc == 0 and ran == ["cuda-tests"]
    assert first["stages"]["train"]["status"] == "skipped" and "['part-1']" in first["stages"]["train"]["reason"]
    rc, second = call("part-1", "call-2")
    assert rc == 0 and ran == ["cuda-tests", "train", "bench-default"]  # cuda-tests did not run twice
    assert second["stages"]["cuda-tests"]["earlier_call"] is True
    assert second["stages"]["cuda-tests"]["figures"] == {"value": 1.0}
    assert second["stages"]["train"]["status"] == "ran" and "earlier_call" not in second["stages"]["train"]
    assert second["headline"]["statuses"] == {"install": "ran", "cuda-tests": "ran", "train": "ran",
                                              "bench-default": "ran"}


def test_a_cold_second_machine_runs_what_it_can_and_says_which_part_is_missing(tmp_path, monkeypatch):
    call, ran = _two_call_setup(tmp_path, monkeypatch)
    call("part-0", "call-1")
    rc, second = call("part-1", "call-2", stash="fresh-machine")
    assert rc == 0 and ran == ["cuda-tests", "cuda-tests"]
    assert second["stages"]["bench-default"]["status"] == "skipped"
    assert "['part-0']" in second["stages"]["bench-default"]["reason"]


def test_a_stage_whose_least_time_exceeds_the_budget_left_is_not_started(tmp_path, monkeypatch):
    """A bench started with too little budget times every variant out and spends the call (H200,
    129 s for the 1B bench); with less left than its ``least_s`` it is skipped and says why."""
    call, ran = _two_call_setup(tmp_path, monkeypatch, bench_least_s=200.0)
    call("part-0", "call-1", budget_s=150)
    rc, second = call("part-1", "call-2", budget_s=150)
    assert rc == 0 and ran == ["cuda-tests", "train"]
    record = second["stages"]["bench-default"]
    assert record["status"] == "skipped" and "needs at least 200 s" in record["reason"]
    assert "give it a call of its own" in record["reason"]


# ------------------------------------------------------------------------------ selection and model size
def test_the_cuda_marked_files_are_found():
    files = {str(p.relative_to(ROOT)) for p in marked_files(ROOT / "tests")}
    assert {"tests/train/test_cuda_path.py", "tests/train/test_models_devices.py"} <= files
    assert "tests/train/test_config_ergonomics.py" not in files  # mentions CUDA, marks nothing


def test_only_tests_that_need_a_gpu_are_selected():
    class Item:
        def __init__(self, *reasons: str) -> None:
            self.marks = [pytest.mark.skipif(True, reason=r).mark for r in reasons]

        def iter_markers(self, name: str):
            return (m for m in self.marks if m.name == name)

    assert needs_gpu(Item("needs a CUDA GPU")) and needs_gpu(Item("slow", "needs a GPU with flash-attn"))
    assert not needs_gpu(Item("checks the refusal on a machine without CUDA")) and not needs_gpu(Item())


def test_the_1b_shape_has_about_a_billion_parameters():
    count = random_llama.parameter_count(random_llama.SHAPES["1b"], 49152)
    assert 1.0e9 < count < 1.2e9
    with pytest.raises(ValueError, match="size: expected one of"):
        random_llama.shape_of("7b")


def test_the_3b_and_8b_shapes_count_as_meta_s_with_meta_s_vocabulary():
    """Per layer: attention 2 h^2 + 2 h kv d (d = h / heads), MLP 3 h m, two norms 2 h; plus the
    tied embedding V h and the final norm h. 3b (h 3072, kv 8 x 128, m 8192, 28 layers): 100,669,440
    a layer; with V = 128,256: 2,818,744,320 + 394,002,432 + 3,072 = 3,212,749,824, Meta's 3.21e9.
    8b (h 4096, kv 8 x 128, m 14336, 32 layers): 218,112,000 a layer; V = 128,256 plus Meta's untied
    head (V h more): 6,979,584,000 + 2 x 525,336,576 + 4,096 = 8,030,261,248, Meta's 8.03e9. With
    the embedded tokenizer's 49,152: 2,969,742,336 and 7,180,914,688."""
    shapes, count = random_llama.SHAPES, random_llama.parameter_count
    assert count(shapes["3b"], 128256) == 3_212_749_824
    assert count(shapes["8b"], 128256) + 128256 * 4096 == 8_030_261_248
    assert count(shapes["3b"], 49152) == 2_969_742_336 and count(shapes["8b"], 49152) == 7_180_914_688


def test_a_tiny_random_llama_matches_its_parameter_count_and_reloads(tmp_path):
    from transformers import AutoModelForCausalLM

    from tether.models.tiny import byte_tokenizer

    tok = byte_tokenizer()
    path = random_llama.build_random_llama("tiny", tmp_path / "m", tokenizer=tok, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert model.num_parameters() == random_llama.parameter_count(random_llama.SHAPES["tiny"], len(tok))
    assert model.config.num_key_value_heads == 2 and model.config.tie_word_embeddings
    assert random_llama.build_random_llama("tiny", tmp_path / "m", tokenizer=tok, dtype="float32") == path  # reused
    with pytest.raises(FileExistsError, match="not empty"):
        random_llama.build_random_llama("tiny", tmp_path / "m", tokenizer=tok, dtype="bfloat16")


def test_the_train_stage_s_gain_is_held_to_the_range_of_the_recorded_cpu_runs(tmp_path):
    """The default config's CPU runs, push off: a `make train` record gaining 18 -> 59 % (41
    points) and frontier budget-t3 runs gaining 41 and 47; a push-on run, another task's run and
    another point are left out. Gains 41, 41, 47: mean 43, sd sqrt(12) = 3.4641, t(2) = 4.303, one
    more run falls in 43 -+ 4.303 * 3.4641 * sqrt(4 / 3) = 43 -+ 17.212: 25.788 to 60.212."""
    config = dict(gpu_stages.DEFAULT_CONFIG)
    default_runs = [{"config": config, "summary": {"accuracy_before": 0.18, "accuracy_after": 0.59}},
                    {"config": {**config, "kl_push": True}, "summary": {"accuracy_before": 0.18, "accuracy_after": 0.99}},
                    {"config": {**config, "task": "tools"}, "summary": {"accuracy_before": 0.18, "accuracy_after": 0.99}}]
    frontier_runs = [{"point": "budget-t3", "mode": "reduced", "accuracy_before": 0.18, "heldout_accuracy": h}
                     for h in (0.59, 0.65)] + [{"point": "budget-t1", "mode": "reduced", "accuracy_before": 0.18,
                                                "heldout_accuracy": 0.99}]
    for name, rows in (("default_run", default_runs), ("frontier", frontier_runs)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gains = gpu_stages.cpu_gains(tmp_path)
    assert gains == pytest.approx([41.0, 41.0, 47.0], abs=1e-12)
    goal = gpu_stages.gain_goal(60.0, gains)
    assert goal["cpu_runs"] == 3 and goal["cpu_gain_points"] == pytest.approx(43.0, abs=1e-12)
    assert goal["cpu_gain_range"] == pytest.approx([25.788, 60.212], abs=1e-9) and goal["gain_met"] is True
    assert gpu_stages.gain_goal(61.0, gains)["gain_met"] is False and gpu_stages.gain_goal(None, gains)["gain_met"] is False
