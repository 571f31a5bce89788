"""Run directories: nothing of a run is lost to a new run, a failed run, a damaged file or an
edited config; a resume extends a run and refuses what it cannot change (issue 14, items 1-5)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.train.test_recipe import HERE, _metrics, tiny_cfg
from tether.models.tiny import byte_tokenizer, tiny_causal_lm
from tether.train.checkpoint import CheckpointError, CheckpointFallbackWarning
from tether.train.run_dir import RunDirError, read_run_config
from tether.train.cli import main
from tether.train.config import TrainConfig
from tether.train.recipe import RewardError, train


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def steps_kept(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))


def final_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "policy.safetensors"))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step run (checkpoints of steps 1 and 2), copied by the tests that change it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train(tiny_cfg(run, steps=2), progress=False)
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def one_error_line(capsys) -> str:
    """The CLI's error: the last stderr line (libraries may print progress bars before it)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.rstrip("\n").split("\n")[-1]
    assert last.startswith("tether ") and err.endswith("\n"), err
    return last


# ------------------------------------------------------------------------------ item 1: new runs
def test_new_run_refuses_a_directory_that_holds_a_run(finished, tmp_path, capsys):
    """A second run with another seed into the same directory: refused by train() and by the
    CLI (exit 2, one line), and every file of the first run is byte-identical afterwards."""
    run = copy_of(finished, tmp_path)
    before = snapshot(run)
    with pytest.raises(RunDirError, match=r"not empty.*--resume.*--overwrite"):
        train(tiny_cfg(run, seed=1), progress=False)
    args = [f"{k}={v}" for k, v in tiny_cfg(run, seed=1).__dict__.items()]
    assert main(["train", "--quiet", *args]) == 2
    assert str(run) in one_error_line(capsys)
    assert snapshot(run) == before


def test_nothing_is_written_before_everything_is_validated(tmp_path):
    """A model directory that does not exist is found out after the config validated but before
    the run starts: the run directory is never created."""
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="no such directory"):
        train(tiny_cfg(out, model=str(tmp_path / "no-model")), progress=False)
    assert not out.exists()


def test_overwrite_replaces_the_run_and_keeps_other_files(finished, tmp_path):
    """--overwrite: the old run's checkpoints, metrics and summary are gone (no old checkpoint
    beside the new config), a file that is not the run's stays, and the config records no
    overwrite (copying it does not overwrite another run)."""
    run = copy_of(finished, tmp_path)
    (run / "notes.txt").write_text("mine")
    train(tiny_cfg(run, steps=1, seed=1, overwrite=True), progress=False)
    assert steps_kept(run) == ["step_000001"]
    assert [r["step"] for r in _metrics(run)] == [1]
    assert TrainConfig.from_yaml(run / "config.yaml") == tiny_cfg(run, steps=1, seed=1)
    assert (run / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------------------ item 2: failed runs
def test_a_failed_new_run_says_truly_what_the_directory_holds(finished, tmp_path):
    """A run whose reward raises at step 1: in a fresh directory it says no checkpoint was
    written; overwriting a finished run it says the same, and the old checkpoints are gone
    rather than paired with the new config."""
    bad = str(HERE / "bad_task.py")
    with pytest.raises(RewardError, match="holds no checkpoint of this run"):
        train(tiny_cfg(tmp_path / "fresh", task=bad), progress=False)
    run = copy_of(finished, tmp_path)
    with pytest.raises(RewardError, match="holds no checkpoint of this run"):
        train(tiny_cfg(run, task=bad, overwrite=True), progress=False)
    assert not (run / "checkpoints").exists()
    assert TrainConfig.from_yaml(run / "config.yaml").task == bad


# ------------------------------------------------------------------------------ item 3: keep N
def test_resume_falls_back_past_damaged_checkpoints_and_ends_exact(tmp_path):
    """keep_checkpoints=3 keeps steps 2, 3, 4 of a 4-step run. With step 4's policy replaced by
    garbage of the same size and step 3's state.json truncated, a resume warns naming both
    files, starts from step 2, sets 3 and 4 aside, and ends bit-identical to the clean run."""
    clean, run = tmp_path / "clean", tmp_path / "run"
    train(tiny_cfg(clean, steps=4), progress=False)
    train(tiny_cfg(run, steps=4, keep_checkpoints=3), progress=False)
    assert steps_kept(run) == ["step_000002", "step_000003", "step_000004"]
    assert steps_kept(clean) == ["step_000003", "step_000004"]  # the default keeps 2
    policy = run / "checkpoints" / "step_000004" / "policy.safetensors"
    policy.write_bytes(b"\0" * policy.stat().st_size)
    state = run / "checkpoints" / "step_000003" / "state.json"
    state.write_text(state.read_text()[:40])
    with pytest.warns(CheckpointFallbackWarning, match=r"(?s)step_000004/policy.safetensors: contents differ"
                                                      r".*step_000003/state.json: \d+ bytes.*step_000002"):
        train(read_run_config(run), resume=True, progress=False)
    assert {"step_000004.damaged", "step_000003.damaged"} <= {p.name for p in (run / "checkpoints").iterdir()}
    assert _metrics(run) == _metrics(clean)
    assert_same_weights(final_weights(run, 4), final_weights(clean, 4))


DAMAGE = {
    "truncated policy": ("policy.safetensors", lambda p: p.write_bytes(p.read_bytes()[:50]), r"policy.safetensors: 50 bytes"),
    "garbage optimizer": ("optimizer.safetensors", lambda p: p.write_bytes(b"x" * p.stat().st_size), r"optimizer.safetensors: contents differ"),
    "truncated state": ("state.json", lambda p: p.write_text(p.read_text()[:-30]), r"state.json: \d+ bytes"),
    "missing rng": ("rng.safetensors", lambda p: p.unlink(), r"rng.safetensors: missing"),
    "missing manifest": ("manifest.json", lambda p: p.unlink(), r"manifest.json: missing"),
    "garbage manifest": ("manifest.json", lambda p: p.write_text("{"), r"manifest.json: not readable JSON"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_only_checkpoint_names_the_file(finished, tmp_path, case, capsys):
    """Every kept checkpoint damaged the same way: resuming fails naming the file and what is
    wrong with it, through the API and the CLI (exit 2, one line)."""
    run = copy_of(finished, tmp_path)
    name, damage, match = DAMAGE[case]
    for step in (1, 2):
        damage(run / "checkpoints" / f"step_{step:06d}" / name)
    with pytest.raises(CheckpointError, match=f"no intact checkpoint.*{match}"):
        train(read_run_config(run), resume=True, progress=False)
    assert main(["train", "--quiet", "--resume", str(run), "--steps", "3"]) == 2
    assert name in one_error_line(capsys)


@pytest.mark.parametrize("edit,match", [
    (lambda text: text[: text.index('"step": 2') + 5], r"metrics.jsonl: the lines of steps 1..2.*missing \[2\]"),
    (lambda text: "{oops\n" + text.split("\n", 1)[1], r"metrics.jsonl: line 1 is not valid JSON"),
])
def test_a_damaged_metrics_log_names_the_file(finished, tmp_path, edit, match):
    """metrics.jsonl cut inside step 2's line (the unfinished line is dropped, then step 2 is
    missing) or with a garbage first line: the resume names the file and the problem."""
    run = copy_of(finished, tmp_path)
    log = run / "metrics.jsonl"
    log.write_text(edit(log.read_text()))
    with pytest.raises(ValueError, match=match):
        train(read_run_config(run), resume=True, progress=False)


# ------------------------------------------------------------------------------ item 4: the base
def save_tiny(path: Path, seed: int, hidden: int = 64) -> Path:
    tokenizer = byte_tokenizer()
    tiny_causal_lm(tokenizer, hidden=hidden, layers=2, seed=seed, head_scale=1.0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_checkpoint_refuses_another_base_of_the_same_shapes(tmp_path, capsys):
    """A LoRA run on model directory A. Replacing A's weights by those of B (same shapes,
    another seed) makes resume and eval refuse, naming both fingerprints; pointing
    config.yaml's model at B is refused naming both models."""
    a, b = save_tiny(tmp_path / "a", seed=0), save_tiny(tmp_path / "b", seed=1)
    run = tmp_path / "run"
    train(tiny_cfg(run, steps=1, model=str(a), lora_rank=2, lora_targets="q_proj,v_proj"), progress=False)
    recorded = json.loads((run / "checkpoints" / "step_000001" / "state.json").read_text())["base"]
    assert recorded["model"] == str(a) and len(recorded["weights"]) == len(recorded["tokenizer"]) == 64

    config = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(config.replace(str(a), str(b)))
    with pytest.raises(CheckpointError, match=rf"model \('{a}' -> '{b}'\)"):
        train(read_run_config(run), resume=True, progress=False)

    (run / "config.yaml").write_text(config)
    shutil.copy(b / "model.safetensors", a / "model.safetensors")
    pattern = rf"trained on base model '{a}' \(weights {recorded['weights'][:12]}.*now loads weights (?!{recorded['weights'][:12]})"
    with pytest.raises(CheckpointError, match=pattern):
        train(read_run_config(run), resume=True, progress=False)
    assert main(["eval", str(run), "--trust-task-code"]) == 2
    assert "trained on base model" in one_error_line(capsys)


def test_an_edited_lora_rank_or_width_names_the_config_and_checkpoint(finished, tmp_path):
    """config.yaml edited after the run: lora_rank 0 -> 4, or a model of another width, is
    refused naming the key with both values and the checkpoint."""
    run = copy_of(finished, tmp_path)
    edited = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**edited, "lora_rank": 4}))
    with pytest.raises(CheckpointError, match=r"step_000002: written with another config.*lora_rank \(0 -> 4\)"):
        train(read_run_config(run), resume=True, progress=False)
    wide = save_tiny(tmp_path / "wide", seed=0, hidden=32)
    (run / "config.yaml").write_text(yaml.safe_dump({**edited, "model": str(wide)}))
    with pytest.raises(CheckpointError, match=rf"model \('tiny' -> '{wide}'\)"):
        train(read_run_config(run), resume=True, progress=False)


# ------------------------------------------------------------------------------ item 5: overrides
def test_resume_with_steps_extends_the_run_exactly(finished, tmp_path, capsys):
    """`--resume RUN --steps 3` on a finished 2-step run runs step 3 and ends with the metrics
    and weights of an uninterrupted 3-step run; config.yaml then says 3. Changing the seed,
    asking fewer steps than done, or adding --overwrite is refused by name (exit 2)."""
    run = copy_of(finished, tmp_path)
    clean = tmp_path / "clean"
    train(tiny_cfg(clean, steps=3), progress=False)
    assert main(["train", "--quiet", "--resume", str(run), "--steps", "3", "checkpoint_every=2"]) == 0
    assert _metrics(run) == _metrics(clean)
    assert_same_weights(final_weights(run, 3), final_weights(clean, 3))
    assert TrainConfig.from_yaml(run / "config.yaml") == tiny_cfg(run, steps=3, checkpoint_every=2)
    capsys.readouterr()
    for extra, match in ((["--seed", "5"], "cannot change seed (0 -> 5)"),
                         (["--steps", "2"], "steps: 2 is below the step of"),
                         (["--overwrite"], "--overwrite contradict"),
                         (["--out", str(clean)], "a resume writes into the run it continues")):
        assert main(["train", "--quiet", "--resume", str(run), *extra]) == 2
        assert match in one_error_line(capsys)


# ------------------------------------------------------------------------------ issue 27, item 8
def test_resume_of_a_finished_run_says_so_and_changes_nothing(finished, tmp_path, capsys):
    """`--resume` on a run whose newest checkpoint is at `steps` with summary.json written prints
    one line saying it is finished and how to extend or score it, exits 0, and leaves every file
    byte-identical (the final evaluation is not run again). Without summary.json (a run stopped
    in its final evaluation) the resume runs that evaluation and writes the summary."""
    run = copy_of(finished, tmp_path)
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", "--quiet", "--resume", str(run)]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == [
        f"tether train: {run} is finished (step 2 of 2, summary.json written); nothing to resume. Train on with "
        f"--resume {run} --steps N (N > 2); score it with tether eval {run}."], out
    assert snapshot(run) == before
    (run / "summary.json").unlink()
    assert main(["train", "--quiet", "--resume", str(run)]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert "is finished" not in capsys.readouterr().out


def test_eval_says_which_checkpoint_and_step_it_scores(finished, tmp_path, capsys):
    """`tether eval RUN` names the checkpoint it loaded and its step on stderr, shows a progress
    bar over the held-out problems there (ending at 2/2), and the JSON on stdout carries both; an
    untrained model is step 0 with no checkpoint."""
    run = copy_of(finished, tmp_path)
    capsys.readouterr()
    assert main(["eval", str(run), "--trust-task-code", "--eval-size", "2"]) == 0
    out = capsys.readouterr()
    checkpoint = run / "checkpoints" / "step_000002"
    assert f"tether eval: scoring {checkpoint} (step 2 of 2) on 2 held-out problems" in out.err.splitlines()
    assert any(line.startswith("held-out evaluation: 100%") and " 2/2 " in line for line in out.err.splitlines())
    result = json.loads(out.out)
    assert (result["checkpoint"], result["step"], result["n"]) == (str(checkpoint), 2, 2)
    assert main(["eval", "--model", "tiny", "--eval-size", "1"]) == 0
    out = capsys.readouterr()
    assert "tether eval: scoring the untrained model 'tiny' (step 0) on 1 held-out problems" in out.err.splitlines()
    assert (json.loads(out.out)["checkpoint"], json.loads(out.out)["step"]) == (None, 0)


# ------------------------------------------------------------------------------ issue 27, item 2: Ctrl-C
def test_ctrl_c_prints_one_line_with_the_resume_command_and_loses_nothing(tmp_path):
    """SIGINT to `tether train` (progress bar on) once step 2 is logged: exit status 130, no
    traceback, and the last stderr line names the newest intact checkpoint (the one a resume
    loads) and the exact --resume command. Resuming from it with --steps K+1 ends with the
    metrics and weights of a clean (K+1)-step run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.train.test_recipe import _weights
    from tether.train.checkpoint import newest_intact

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "tether.train.cli", "train",
           *[f"{k}={v}" for k, v in tiny_cfg(run, steps=500).__dict__.items()]]
    # A shell's background job (``cmd &``) starts with SIGINT ignored, and Python keeps an ignored
    # SIGINT ignored: the child gets the default disposition back, as a terminal's Ctrl-C would find it.
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            stderr=subprocess.PIPE, text=True)
    metrics, deadline = run / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 130 and "Traceback" not in err, err
    newest, _ = newest_intact(run)
    step = int(newest.name.split("_")[1])
    assert 1 <= step < 500, err  # the signal may land while step 2 is saved: then step 1 is the newest intact
    assert err.splitlines()[-1] == (f"tether train: interrupted; the newest intact checkpoint is {newest} (step "
                                    f"{step} of 500); continue with: tether train --resume {run}"), err
    assert main(["train", "--quiet", "--resume", str(run), "--steps", str(step + 1)]) == 0
    clean = tmp_path / "clean"
    train(tiny_cfg(clean, steps=step + 1), progress=False)
    assert _metrics(run) == _metrics(clean), (step, err)
    assert_same_weights(_weights(run), _weights(clean))


def test_ctrl_c_before_the_first_checkpoint_and_on_other_ranks(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the run is being set up (here: while the reward file loads, before the models):
    one line saying no checkpoint exists yet (nothing written, so no --overwrite needed), status
    130. A copied recipe's line resumes with python COPY. A rank started by tether's launcher, or a
    rank other than 0, prints nothing (its launcher or rank 0 speaks for the run)."""
    finished_run = tmp_path / "copied"
    train(tiny_cfg(finished_run, steps=1), progress=False)
    interrupting = tmp_path / "interrupting_rewards.py"
    interrupting.write_text("raise KeyboardInterrupt  # the user's Ctrl-C, while tether reads this file\n")
    run = tmp_path / "run"
    args = ["train", "--quiet", *[f"{k}={v}" for k, v in tiny_cfg(run, reward_funcs=str(interrupting)).__dict__.items()]]
    assert main(args) == 130
    out = capsys.readouterr()
    assert out.err.splitlines() == [f"tether train: interrupted before the first checkpoint of {run}: no checkpoint "
                                    "exists yet, so there is nothing to resume; run the same command again to start "
                                    "over."] and out.out == "" and not run.exists()

    def stopped(cfg, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr("sys.argv", ["my_recipe.py"])
    copied = ["train", "--quiet", *[f"{k}={v}" for k, v in tiny_cfg(finished_run, steps=1).__dict__.items()]]
    assert main(copied, train_fn=stopped) == 130
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"(step 1 of 1); continue with: python my_recipe.py --resume {finished_run}")
    for env in ({"RANK": "1"}, {"RANK": "0", "TETHER_LAUNCHED": "1"}):
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            assert main(args) == 130
        assert capsys.readouterr().err == ""


def test_a_ctrl_c_inside_a_finaliser_reaches_the_run_with_nothing_printed():
    """Python drops an exception raised in ``__del__`` after printing it ("Exception ignored
    in ...", seen once when the Ctrl-C test's SIGINT landed in regex's finaliser); within
    ``interrupts_reach_the_run`` the KeyboardInterrupt comes back in the main thread instead, and
    the hook that was there before is back afterwards. In a fresh process with Python's SIGINT
    handler: a suite started as a background job ignores SIGINT, and so ignores the re-delivery."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import signal, sys, time
        # A background job (CI started with &) has SIGINT ignored, which interrupt_main honours;
        # a terminal's process has Python's default handler.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from tether.train.interrupt import interrupts_reach_the_run
        hook = sys.unraisablehook
        class Dies:
            def __del__(self):
                raise KeyboardInterrupt
        try:
            with interrupts_reach_the_run():
                Dies()
                deadline = time.monotonic() + 60  # the interrupt comes from another thread
                while time.monotonic() < deadline:
                    time.sleep(0.01)
            print("not interrupted")
        except KeyboardInterrupt:
            print("interrupted", sys.unraisablehook is hook)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "interrupted True" and "Exception ignored" not in done.stderr, done.stderr
