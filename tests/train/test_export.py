"""``tether export``: the exported directory reloads with plain transformers / PEFT and scores
exactly like the trained policy; bad targets and runs are refused with named errors."""

from __future__ import annotations

import copy
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.train.test_recipe import tiny_cfg
from tether.models import TransformersWrapper
from tether.train.run_dir import read_run_config
from tether.train.cli import main
from tether.train.export import export_run
from tether.train.recipe import train
from tether.models.loading import load_base
from tether.train.run import build_models

CHAT = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}]


def _log_probs(model, tokenizer) -> torch.Tensor:
    """Log-probs of a rendered chat and of a byte string (two rows, right padded)."""
    rows = [tokenizer.apply_chat_template(CHAT, tokenize=False), "12 + 30 = 42"]
    enc = tokenizer(rows, return_tensors="pt", padding=True, add_special_tokens=False)
    scorer = TransformersWrapper(model, tokenizer, input_mode="tokens", generate=False)
    with torch.no_grad():
        return scorer.score(enc["input_ids"], enc["attention_mask"].bool()).log_probs


def _trained_policy(run: Path):
    """The run's policy rebuilt from config.yaml with the last checkpoint's weights copied in by name."""
    cfg = read_run_config(run)
    models = build_models(cfg)
    step = (run / "checkpoints" / "latest").read_text()
    params = dict(models.policy.named_parameters())
    with torch.no_grad():
        for name, value in load_file(str(run / "checkpoints" / step / "policy.safetensors")).items():
            params[name].copy_(value)
    return models.policy, models.tokenizer


@pytest.fixture(scope="module", params=[0, 4], ids=["full", "lora"])
def trained(request, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export") / "run"
    train(tiny_cfg(run, steps=2, lora_rank=request.param, learning_rate=5e-3), progress=False)
    return run


@pytest.mark.parametrize("merge", [False, True])
def test_export_reloads_with_the_trained_log_probs(trained, tmp_path, merge):
    """Reloaded with ``AutoModelForCausalLM`` (whole model) or ``PeftModel`` (adapter), the export
    scores two sequences with the trained policy's log-probs within 1e-5, while the untrained base
    differs (so the comparison could fail); the tokenizer keeps its vocabulary and chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    lora = read_run_config(trained).lora_rank > 0
    umask = os.umask(0o022)
    try:
        assert main(["export", str(trained), str(out), *(["--merge"] if merge else [])]) == 0
    finally:
        os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert set(modes.values()) == {0o644} and any(name.endswith(".safetensors") for name in modes), modes
    policy, tokenizer = _trained_policy(trained)
    expected = _log_probs(policy, tokenizer)
    reloaded_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert reloaded_tok.chat_template == tokenizer.chat_template and reloaded_tok.get_vocab() == tokenizer.get_vocab()
    record = json.loads((out / "tether_export.json").read_text())
    assert record["step"] == 2 and record["kind"] == ("adapter" if lora and not merge else "merged" if lora else "full")
    assert (record["run"], record["checkpoint"]) == (trained.name, "checkpoints/step_000002")
    assert str(tmp_path.parent) not in json.dumps(record)  # no absolute path of this machine
    base, _ = load_base("tiny", read_run_config(trained).seed)
    if lora and not merge:
        from peft import PeftModel

        assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
        model = PeftModel.from_pretrained(base, out).eval()
    else:
        assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
        model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    got = _log_probs(model, reloaded_tok)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    base_lp = _log_probs(load_base("tiny", read_run_config(trained).seed)[0], tokenizer)
    assert float((base_lp - expected).abs().max()) > 1e-3


def test_export_and_eval_refuse_a_non_empty_out_and_a_missing_best(trained, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="OUT: .*taken is a directory that is not empty"):
        export_run(trained, out)
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="--best: .*no best checkpoint.*eval_every"):
        export_run(trained, tmp_path / "fresh", best=True)
    assert not (tmp_path / "fresh").exists()
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tether export: ") and "config.yaml: not found" in err
    capsys.readouterr()
    assert main(["eval", str(trained), "--best", "--trust-task-code"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tether eval: --best: ") and "no best checkpoint" in err
    assert main(["eval", "--best"]) == 2
    assert "give the run directory" in capsys.readouterr().err


@pytest.mark.integration
def test_export_of_the_embedded_gguf_model_is_a_plain_hf_directory(tmp_path):
    """A LoRA run on ``--model default`` (loaded from GGUF) exports, merged, to config.json +
    model.safetensors + tokenizer files that ``AutoModelForCausalLM`` loads with no GGUF
    quantization config, scoring like the adapted policy within 1e-5. The checkpoint is written
    directly (adapter weights set at random) instead of by a slow training run.

    Compared in float64: the merged float32 weights then differ from the adapted policy only by
    their rounding. In float32 both sides carry the 30-layer model's own rounding (measured:
    the float32 policy is 1.8e-5 from its float64 log-probs, the merged one 2.0e-5), so a
    merged model and its adapter agree to ~3e-5 there whatever the export does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tether.train.checkpoint import checkpoint_record, save_checkpoint
    from tether.train.run_dir import start_new_run
    from tether.train.config import TrainConfig

    run, out = tmp_path / "run", tmp_path / "out"
    cfg = TrainConfig(model="default", out=str(run), lora_rank=2, lora_targets="q_proj,v_proj")
    start_new_run(cfg)
    models = build_models(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in models.policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    expected = _log_probs(copy.deepcopy(models.policy).double(), models.tokenizer)
    optimizer = torch.optim.AdamW([p for p in models.policy.parameters() if p.requires_grad])
    state = {"data_cursor": 0, "controller": {}, **checkpoint_record(cfg, models.fingerprint)}
    save_checkpoint(run, 1, policy=models.policy, optimizer=optimizer, state=state, rng={"torch": torch.get_rng_state()})
    del models
    assert export_run(run, out, merge=True).kind == "merged"
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config.get("torch_dtype", config.get("dtype")) == "float32"
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, torch_dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert "<|im_start|>" in tokenizer.chat_template
    torch.testing.assert_close(_log_probs(model, tokenizer), expected, rtol=0, atol=1e-5)


def test_push_to_hub_without_network_leaves_the_card_and_says_how_to_push(trained, tmp_path):
    """``--push-to-hub`` with a token but a Hub endpoint that refuses connections (a closed local
    port): OUT holds what would be uploaded (the model, a model card whose front matter names the
    library and base, summary.json's figures, the leash settings, the config, the plots) and the
    command fails with one line that names the repo and the ``hf upload`` command."""
    import subprocess
    import sys

    import yaml

    out = tmp_path / "card"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_TOKEN="hf_not_a_real_token", HF_HOME=str(tmp_path / "hf"),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "tether.train", "export", str(trained), str(out), "--push-to-hub",
                           "me/tiny-grpo"], env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("tether export:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert "me/tiny-grpo" in errors[0] and f"hf upload me/tiny-grpo {out} ." in errors[0]
    card = (out / "README.md").read_text()
    _, front, body = card.split("---\n", 2)
    meta = yaml.safe_load(front)
    kind = json.loads((out / "tether_export.json").read_text())["kind"]
    assert meta["library_name"] == ("peft" if kind == "adapter" else "transformers") and "grpo" in meta["tags"]
    summary = json.loads((trained / "summary.json").read_text())
    assert (f"| `accuracy_after` | {summary['accuracy_after']:.4g} | fraction of the held-out problems answered "
            "right (greedy) |") in body
    assert f"| `eval_kl_per_seq` | {summary['eval_kl_per_seq']:.4g} | nats per answer, summed over its tokens |" in body
    assert f"| `kl_controller` | {read_run_config(trained).kl_controller} |" in body
    assert read_run_config(trained).to_yaml().strip() in body
    assert {p.name for p in (out / "figures").iterdir()} == {"overview.png", "kl_per_seq.png"}
    assert "![overview.png](figures/overview.png)" in body
