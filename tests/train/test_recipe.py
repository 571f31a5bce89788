"""``tether train`` on the tiny model: files, exact resume after SIGKILL, accumulation, errors."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tether.train.config import TrainConfig
from tether.train.plots import PLOTTED, curve_data, plot_metrics, plotted_panels
from tether.train import recipe
from tether.train.recipe import (RewardError, accumulate_gradients, add_advantages, add_reference, build_run, sample,
                                 add_rewards, step_problems, train)

HERE = Path(__file__).parent
COUNT_TASK = str(HERE / "count_task.py")
TIMING_KEYS = {"step_time", "tokens_per_s", "kl_move_seconds"}


def prepared(run, step: int = 0, rollout=sample):
    """Step ``step``'s record after the rollout, reward, reference and advantage stages (what the
    loss reads), with the reward scores."""
    problems = step_problems(run, step)
    record = rollout(run, problems, step)
    scores = add_rewards(run, record, problems, step)
    add_reference(run, record)
    add_advantages(run, record)
    return record, scores


class _Killed(Exception):
    """Stands for the process dying between two steps."""


def interrupted_train(cfg: TrainConfig, after: int) -> None:
    """Run ``cfg`` as if the process died once ``after`` steps were done: what the run directory
    holds is what the loop had written by then (checkpoints at its cadence, logs). The death comes
    through the loop's public ``rollout`` seam, at the start of step ``after + 1``."""

    def rollout(run, problems, step):
        if step >= after:
            raise _Killed
        return sample(run, problems, step)

    with pytest.raises(_Killed):
        train(cfg, progress=False, rollout=rollout)


def tiny_cfg(out: Path, **kw) -> TrainConfig:
    base = dict(model="tiny", task=COUNT_TASK, steps=3, out=str(out), prompts_per_step=2, group_size=3,
                max_new_tokens=6, micro_batch_size=4, eval_size=4, eval_max_new_tokens=6, lora_rank=0,
                learning_rate=1e-3, checkpoint_every=1, threads=1)
    base.update(kw)
    return TrainConfig(**base)


def test_end_to_end_writes_every_file(tmp_path):
    summary = train(tiny_cfg(tmp_path / "run"), progress=False)
    run = tmp_path / "run"
    assert TrainConfig.from_yaml(run / "config.yaml") == tiny_cfg(run)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("reward_mean", "reward_std", "accuracy", "kl_per_seq", "kl_per_token", "kl_coef", "clip_fraction",
                "ess", "entropy", "response_length", "grad_norm", "step_time", "tokens_per_s"):
        assert all(isinstance(r[key], float) and r[key] == r[key] for r in records), key
    assert records[0]["kl_per_seq"] == pytest.approx(0.0, abs=1e-5)  # policy == reference at step 1
    assert any(r["kl_per_seq"] != 0 for r in records[1:])  # and it moved afterwards
    saved = json.loads((run / "summary.json").read_text())
    assert saved == summary and summary["steps"] == 3
    assert summary["seconds_in_steps"] == pytest.approx(sum(r["step_time"] for r in records), rel=1e-12)
    numbers = {k for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert set(summary["units"]) == numbers, numbers ^ set(summary["units"])  # every number has its unit
    assert summary["units"]["eval_kl_per_seq"] == "nats per answer, summed over its tokens"
    assert summary["units"]["steps_over_kl_bound"] == "training steps whose kept weights read over kl_bound"
    for key, _, _ in plotted_panels(yaml.safe_load((run / "config.yaml").read_text())):
        assert (run / "plots" / f"{key}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text()
    assert {p.name for p in latest.iterdir()} >= {"policy.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"}


def test_plot_curves_are_the_metrics(tmp_path):
    records = [{"step": s, **{k: float(s * i) for i, (k, _, _) in enumerate(PLOTTED)}} for s in (1, 2, 3)]
    data = curve_data(records)
    for i, (key, _, _) in enumerate(PLOTTED):
        assert data[key] == ([1, 2, 3], [1.0 * i, 2.0 * i, 3.0 * i])


def test_each_reward_function_gets_its_curve_and_plot(tmp_path):
    """A run scored by two reward functions logs ``reward/<name>`` per step: each becomes a curve
    whose values are the logged ones (NaN at a step that lacks it) and a PNG of its own in
    ``plots/`` (the slash of the key is no folder)."""
    records = [{"step": s, "reward_mean": 0.5, "reward/odd_share": 0.25 * s, **({"reward/level-bonus": 1.0} if s > 1 else {})}
               for s in (1, 2, 3)]
    data = curve_data(records)
    assert data["reward/odd_share"] == ([1, 2, 3], [0.25, 0.5, 0.75])
    assert data["reward/level-bonus"][1][1:] == [1.0, 1.0] and math.isnan(data["reward/level-bonus"][1][0])
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    written = {p.name for p in plot_metrics(run)}
    assert {"reward_odd_share.png", "reward_level-bonus.png"} <= written
    assert (run / "plots" / "reward_odd_share.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _weights(run: Path) -> dict[str, torch.Tensor]:
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text()
    return load_file(str(latest / "policy.safetensors"))


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def test_resume_after_sigkill_is_bit_identical(tmp_path):
    """Kill a 4-step run with SIGKILL once step 2 is logged, resume, compare to a clean run."""
    clean = tmp_path / "clean"
    train(tiny_cfg(clean, steps=4), progress=False)
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "tether.train.cli", "train", "--quiet", *[
        f"{k}={v}" for k, v in tiny_cfg(killed, steps=4).__dict__.items()]]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(metrics.read_text().splitlines()) < 4
    train(TrainConfig.from_yaml(killed / "config.yaml"), resume=True, progress=False)
    assert _metrics(killed) == _metrics(clean)
    a, b = _weights(clean), _weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("update", ["sync", "ema"])
def test_moving_reference_checkpoints_and_resumes_exactly(tmp_path, update):
    """A sync/EMA reference is saved as safetensors (state.json stays plain JSON) and an
    interrupted run resumed from step 2 ends with the same metrics and both weight sets."""
    kw = dict(steps=4, reference_update=update, reference_every=1, reference_alpha=0.5)
    clean = tmp_path / "clean"
    train(tiny_cfg(clean, **kw), progress=False)
    cut = tmp_path / "cut"
    interrupted_train(tiny_cfg(cut, **kw), 2)
    state = json.loads((cut / "checkpoints" / (cut / "checkpoints" / "latest").read_text() / "state.json").read_text())
    assert state["reference_updater"]["num_updates"] == 2 and "reference" not in state["reference_updater"]
    train(TrainConfig.from_yaml(cut / "config.yaml"), resume=True, progress=False)
    assert _metrics(cut) == _metrics(clean)
    assert any(r["kl_per_seq"] != 0 for r in _metrics(clean))
    for name in ("policy.safetensors", "reference.safetensors"):
        a, b = (load_file(str(r / "checkpoints" / (r / "checkpoints" / "latest").read_text() / name)) for r in (clean, cut))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_gradient_accumulation_invariance(tmp_path, aggregation):
    """The step's gradient does not depend on the micro-batch size (6 rows: 6x1 vs 1x6 vs 2x3)."""
    grads = []
    for micro in (6, 1, 3):
        run = build_run(tiny_cfg(tmp_path / f"m{micro}", micro_batch_size=micro, aggregation=aggregation))
        record, _ = prepared(run)
        accumulate_gradients(run, record)
        grads.append({n: p.grad.clone() for n, p in run.models.policy.named_parameters() if p.grad is not None})
    assert grads[0] and any(g.abs().sum() > 0 for g in grads[0].values())
    # float32 model: micro-batches of different sizes (and prompt sharing within them) sum
    # the same terms in different orders, so allow rounding relative to each tensor's scale.
    for other in grads[1:]:
        for name, g in grads[0].items():
            torch.testing.assert_close(other[name], g, rtol=1e-5, atol=1e-6 * float(g.abs().max()), msg=name)


def test_config_errors_are_reported_together():
    cfg = TrainConfig(steps=0, group_size=1, temperature=-1.0, aggregation="mean", task="no-such-task")
    with pytest.raises(ValueError) as err:
        cfg.validate()
    text = str(err.value)
    for fragment in ("steps", "group_size", "temperature", "aggregation", "task"):
        assert fragment in text
    with pytest.raises(ValueError, match="unknown key .stepz.; did you mean .steps."):
        TrainConfig.from_dict({"stepz": 3})
    with pytest.raises(ValueError, match="steps: expected int"):
        TrainConfig().override({"steps": "three"})


@pytest.mark.parametrize("task_file,match", [("bad_task.py", "raised ZeroDivisionError.*sample 0"),
                                             ("nan_task.py", "returned nan.*sample 0")])
def test_reward_failures_name_the_sample(tmp_path, task_file, match):
    out = tmp_path / "run"
    with pytest.raises(RewardError, match=match):
        train(tiny_cfg(out, task=str(HERE / task_file)), progress=False)
    assert TrainConfig.from_yaml(out / "config.yaml").task.endswith(task_file)
    assert (out / "metrics.jsonl").read_text() == ""


def test_cli_help_lists_field_docs(capsys):
    from tether.train.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "--prompts-per-step" in text and "Distinct prompts per step." in text


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum"])
def test_logged_diagnostics_equal_one_full_batch_call_off_policy(tmp_path, aggregation):
    """Micro-batch sizes 1, 3 and 6 log the diagnostics of one full-batch call of the recipe's loss.

    The sampling log-probs are shifted by a per-token offset inside the assistant mask and the
    advantages have both signs, so the ratios are not 1, the clip acts and ESS < 1. ESS = (sum w)^2 / (n sum w^2) of the whole
    batch is not a token-weighted mean of micro-batch ESS values (averaging per-row ESS over
    rows of different weights overstates it), so only a reduction over the concatenated
    per-token terms can match it.
    """
    run = build_run(tiny_cfg(tmp_path / "run", aggregation=aggregation, kl_coef=0.3))
    run.optimizer.param_groups[0]["lr"] = 0.0  # the updates leave the weights alone: every call sees one policy
    record, _ = prepared(run)
    mask = record.assistant_mask
    offset = torch.linspace(-0.6, 0.6, mask.numel()).reshape(mask.shape) * mask
    record.sample_log_probs = record.sample_log_probs + offset
    signs = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])[:, None]  # so that both clip sides act
    record.advantages = signs.expand_as(mask) * mask
    with torch.no_grad():
        full = recipe.reduce(run, recipe.token_terms(run, record))
    assert float(full.ESS) < 0.99 and float(full.clip_fraction) > 0
    for micro in (1, 3, len(record)):
        run.cfg.micro_batch_size = micro
        logged = recipe.optimize(run, record, 0).output  # what train_step logs
        for name in ("ESS", "clip_fraction", "entropy", "kl_to_ref", "kl_approx"):
            assert float(getattr(logged, name)) == pytest.approx(float(getattr(full, name)), rel=1e-5, abs=1e-7), (micro, name)
        assert float(logged.total_loss()) == pytest.approx(float(full.total_loss()), rel=1e-5, abs=1e-7)