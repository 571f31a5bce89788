"""Config ergonomics: did-you-mean, TRL ``GRPOConfig`` names, registry-backed choices, and the
CLI's one-line user errors (status 2, no traceback)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tether.train.cli import main
from tether.integrations.trl import TRL_NAMES, TRLNameNote, translate
from tether.train.config import TrainConfig, config_choices


def test_unknown_key_suggests_the_closest_field_or_trl_name():
    with pytest.raises(ValueError, match=r"unknown key 'lerning_rate'; did you mean 'learning_rate'\?"):
        TrainConfig().override({"lerning_rate": "1e-3"})
    with pytest.raises(ValueError, match=r"'num_generation'; did you mean 'num_generations' \(TRL's name for group_size\)"):
        TrainConfig.from_dict({"num_generation": 4})
    with pytest.raises(ValueError, match=r"unknown key 'qqqq' \(no close match; `tether train --help`"):
        TrainConfig().override({"qqqq": 1})


def test_trl_names_map_to_tether_fields_with_one_note_each():
    """Each TRL value below read by hand through TRL's GRPOConfig docs: beta is the k3 KL
    coefficient (kl_coef), loss_type=dr_grpo divides by a constant (max_new_tokens) per answer
    (seq-mean-token-sum-norm), scale_rewards=False centres without dividing by std (dr_grpo)."""
    trl = {"beta": 0.04, "num_generations": 8, "max_completion_length": 64, "epsilon": 0.2,
           "epsilon_high": 0.28, "loss_type": "dr_grpo", "scale_rewards": False, "bf16": True,
           "max_steps": 5, "per_device_train_batch_size": 16, "save_steps": 2, "use_cpu": "true"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = TrainConfig().override(trl)
    expected = dict(kl_coef=0.04, group_size=8, max_new_tokens=64, clip_epsilon=0.2, clip_epsilon_high=0.28,
                    aggregation="seq-mean-token-sum-norm", advantage="dr_grpo", dtype="bfloat16", steps=5,
                    micro_batch_size=16, checkpoint_every=2, device="cpu")
    assert {k: getattr(cfg, k) for k in expected} == expected
    notes = [str(w.message) for w in caught if issubclass(w.category, TRLNameNote)]
    assert len(notes) == len(trl) and all("\n" not in n for n in notes)
    assert any(n.startswith("TRL's beta=0.04 read as kl_coef=0.04") for n in notes)
    cfg.validate()


def test_trl_beta_note_says_tether_moves_beta_and_the_current_cap_name_maps():
    """TRL's beta is a fixed coefficient; tether's default budget controller only starts from it,
    so the note says so and names the flag that keeps TRL's meaning (the default stays budget).
    TRL 1.16 calls the importance-weight cap vllm_importance_sampling_clip_max; the older name
    vllm_importance_sampling_cap still maps to the same key."""
    for name in ("vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = TrainConfig().override({"beta": 0.04, name: 3.5, "importance_correction": "tis"})
        assert (cfg.kl_coef, cfg.importance_cap, cfg.kl_controller) == (0.04, 3.5, "budget")
        notes = [str(w.message) for w in caught if issubclass(w.category, TRLNameNote)]
        beta = [n for n in notes if n.startswith("TRL's beta=0.04 read as kl_coef=0.04")]
        assert len(beta) == 1 and "\n" not in beta[0]
        assert "constant coefficient" in beta[0] and "--kl-controller constant" in beta[0]
        assert any(n.startswith(f"TRL's {name}=3.5 read as importance_cap=3.5") for n in notes)
        cfg.validate()
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_max.*and vllm_importance_sampling_cap both"
                                         "|vllm_importance_sampling_cap.*and vllm_importance_sampling_clip_max both"):
        TrainConfig().override({"vllm_importance_sampling_clip_max": 3.0, "vllm_importance_sampling_cap": 2.0})


def test_trl_names_in_a_yaml_file(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("beta: 0.1\nnum_generations: 4\nloss_type: grpo\nlearning_rate: 1.0e-5\n")
    with pytest.warns(TRLNameNote):
        cfg = TrainConfig.from_yaml(path)
    assert (cfg.kl_coef, cfg.group_size, cfg.aggregation, cfg.learning_rate) == (0.1, 4, "seq-mean-token-mean", 1e-5)


@pytest.mark.parametrize("values,match", [
    ({"fp16": True}, r"fp16 \(a TRL GRPOConfig name\) has no tether equivalent: .*dtype=bfloat16"),
    ({"gradient_accumulation_steps": 4}, "no tether equivalent: .*prompts_per_step and micro_batch_size"),
    ({"top_p": 0.9}, "no tether equivalent: .*only temperature"),
    ({"loss_type": "cispo"}, r"loss_type \(TRL, -> aggregation\): expected one of \['bnpo', 'dapo', 'dr_grpo', 'grpo'\]"),
    ({"scale_rewards": "batch"}, "scale_rewards .*got 'batch'"),
    ({"beta": 0.1, "kl_coef": 0.2}, r"beta \(TRL name for kl_coef\) and kl_coef both given; keep one"),
    ({"bf16": True, "torch_dtype": "float32"}, "and bf16 both given|and torch_dtype both given"),
    ({"num_generations": "eight"}, r"group_size \(TRL's num_generations\): expected int, got 'eight'"),
])
def test_trl_names_without_equivalent_or_bad_values_are_explained(values, match):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TRLNameNote)  # no note for a mapping that was refused
        with pytest.raises(ValueError, match=match):
            TrainConfig().override(values)


def test_a_trl_name_for_a_field_this_build_lacks_says_so():
    """A mapping may point at a key another part of tether adds; until then it is named, not dropped."""
    out = translate({"num_iterations": 2}, fields={"steps"})
    assert out.values == {} and out.notes == []
    assert out.problems == ["num_iterations (TRL) corresponds to tether's updates_per_rollout, which this tether "
                            "version lacks"]


@pytest.mark.parametrize("name", sorted(n for n, e in TRL_NAMES.items() if e.target is not None))
def test_every_mapping_lands_on_a_field_and_a_registered_value(name):
    entry, fields = TRL_NAMES[name], set(TrainConfig.field_names())
    assert name not in fields  # a TRL name that is already a tether key needs no entry
    if entry.target not in fields:
        pytest.skip(f"{entry.target} is added by another part of issue #13")
    table = config_choices().get(entry.target)
    if entry.values is not None and table is not None:
        assert set(entry.values.values()) <= set(table), (name, set(entry.values.values()) - set(table))


def test_choices_are_read_from_the_registries(monkeypatch):
    """A name added to a registry is a valid config value with no edit to config.py."""
    choices = config_choices()
    assert set(choices) >= {"aggregation", "advantage", "kl_mode", "kl_estimator", "kl_controller", "kl_signal",
                            "reference_update", "dtype", "device"}
    for field, table in choices.items():
        monkeypatch.setitem(table, "zz-new", object())
        extra = {"kl_estimator": {"kl_mode": "reward"}}.get(field, {})  # loss mode needs k2/k3
        TrainConfig(**{field: "zz-new", **extra}).validate()
        with pytest.raises(ValueError, match=rf"{field}: expected one of .*'zz-new'.*, got 'zz-missing'"):
            TrainConfig(**{field: "zz-missing", **extra}).validate()


# ------------------------------------------------------------------ the CLI's one-line errors
def _one_line_error(capsys, argv: list[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors exit from inside parse_args
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line and "TRLNameNote" not in line]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_cli_user_errors_are_one_line_with_status_2(tmp_path, capsys):
    out = ["--out", str(tmp_path / "run"), "--quiet"]
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("steps: [1,\n")
    typo_yaml = tmp_path / "typo.yaml"
    typo_yaml.write_text("stepz: 3\n")
    cases = [
        (["train", "--config", str(tmp_path / "absent.yaml"), *out], "absent.yaml: cannot read the config file"),
        (["train", "--task", "no-such-task", *out], "task: expected a registered task"),
        (["train", "--config", str(bad_yaml), *out], "bad.yaml: not valid YAML"),
        (["train", "--config", str(typo_yaml), *out], "typo.yaml: config: unknown key 'stepz'; did you mean 'steps'?"),
        (["train", *out, "lerning_rate=1e-3"], "unknown key 'lerning_rate'; did you mean 'learning_rate'?"),
        (["train", "--lerning-rate", "1e-3", *out], "unrecognized arguments: --lerning-rate; did you mean --learning-rate?"),
        (["train", "--fp16", *out], "fp16 (a TRL GRPOConfig name) has no tether equivalent"),
        (["train", "--dtype", "float16", *out], "dtype: expected one of 'float32', 'bfloat16'"),
        (["train", "--model", str(tmp_path / "no-dir"), *out], "no such directory; check the path"),
        (["train", "--model", "tiny", "--adapter", str(tmp_path), *out], "adapter: expected a directory holding a PEFT"),
    ]
    if not torch.cuda.is_available():
        cases.append((["train", "--model", "tiny", "--device", "cuda", *out], "device='cuda' but torch"))
    for argv, fragment in cases:
        line = _one_line_error(capsys, argv)
        assert fragment in line, (argv, line)
    assert not (tmp_path / "run").exists()


def test_an_error_a_dependency_raised_keeps_its_traceback(tmp_path, capsys, monkeypatch):
    """``--model`` a directory whose ``config.json`` names an architecture transformers does not
    know, with no tokenizer files: transformers itself raises (a ``ValueError`` about the
    tokenizer), not one of tether's checks, so after the one line stderr says where it was raised
    and prints the traceback. A check of tether's (a missing ``tether plot`` directory) stays one
    line unless ``TETHER_TRACEBACK=1``."""
    monkeypatch.delenv("TETHER_TRACEBACK", raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "no-such-architecture"}')
    (model / "model.safetensors").write_bytes(b"")
    code = main(["train", "--model", str(model), "--out", str(tmp_path / "run"), "--quiet"])
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[transformers]")]
    assert code == 2 and err[0].startswith("tether train: ")
    assert "above was raised in" in err[1] and "transformers" in err[1] and "not by a check of tether's" in err[1]
    assert err[2] == "Traceback (most recent call last):"
    assert any(line.strip().startswith('File "') and "transformers" in line for line in err[3:])
    assert len(_one_line_error(capsys, ["plot", str(tmp_path / "absent")]).splitlines()) == 1
    monkeypatch.setenv("TETHER_TRACEBACK", "1")
    assert main(["plot", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[1] == "Traceback (most recent call last):" and err[-1].startswith("ValueError: ")


def test_cli_takes_trl_flags_and_underscore_spellings(tmp_path):
    """``--beta``, a bare ``--bf16`` and ``--learning_rate`` reach the config as tether keys."""
    seen = {}

    def fake_train(cfg, **_):
        seen["cfg"] = cfg
        return {}

    with pytest.warns(TRLNameNote) as notes:
        code = main(["train", "--model", "tiny", "--beta", "0.05", "--bf16", "--learning_rate", "3e-4",
                     "--num_generations", "3", "--out", str(tmp_path / "r"), "--quiet"], train_fn=fake_train)
    assert code == 0
    cfg = seen["cfg"]
    assert (cfg.kl_coef, cfg.dtype, cfg.learning_rate, cfg.group_size) == (0.05, "bfloat16", 3e-4, 3)
    assert len(notes) == 3  # beta, bf16, num_generations; learning_rate is tether's own key


def test_the_docs_list_every_trl_name():
    page = (Path(__file__).parents[2] / "docs" / "trl.md").read_text()
    missing = [name for name in TRL_NAMES if f"`{name}`" not in page]
    assert not missing, f"docs/trl.md's table of TRL names lacks {missing}"


def test_help_shows_every_choice_fields_names(capsys):
    """`tether train --help` shows each choice field's registry names as its metavar
    (`--dtype {float32,bfloat16,...}`), not STR; other fields keep their type."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    choices = config_choices()
    assert {"dtype", "device"} <= choices.keys()
    for name, table in choices.items():
        flag = f"--{name.replace('_', '-')}"
        assert f"{flag} {{{','.join(table)}}}" in text and f"{flag} STR" not in text, name
    assert "--dtype {float32,bfloat16" in text and "--device {auto,cpu,cuda" in text
    assert "--steps INT" in text and "--model STR" in text and "--learning-rate FLOAT" in text


WARNING_SCRIPT = """
import warnings
from tether.train import cli, cli_plot
from tether.integrations.trl import TRLNameNote

def fake_plot(args):
    warnings.warn_explicit("`is_x` is deprecated", FutureWarning, "/lib/transformers/modeling_utils.py", 33,
                           module="transformers.modeling_utils")
    warnings.warn_explicit("a user warning of another library", UserWarning, "/lib/other/thing.py", 7,
                           module="other.thing")
    warnings.warn("TRL's beta=0.1 read as kl_coef=0.1", TRLNameNote)
    return 0

cli_plot.run = fake_plot
raise SystemExit(cli.main(["plot", "anything"]))
"""


def test_only_tethers_own_warnings_carry_the_tether_prefix():
    """Run as a program (pytest would record warnings instead of printing them): another
    library's FutureWarning and UserWarning print in Python's form, naming their file; tether's
    own note prints as one `tether:` line."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONWARNINGS": "default"}
    done = subprocess.run([sys.executable, "-c", WARNING_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert "/lib/transformers/modeling_utils.py:33: FutureWarning: `is_x` is deprecated" in lines
    assert "/lib/other/thing.py:7: UserWarning: a user warning of another library" in lines
    assert "tether: TRLNameNote: TRL's beta=0.1 read as kl_coef=0.1" in lines
    assert not any(line.startswith(("tether: FutureWarning", "tether: UserWarning")) for line in lines), lines


# ------------------------------------------------------------------------------ issue 43, item 5
def _notes(values: dict) -> tuple[TrainConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = TrainConfig().override(values)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, TRLNameNote)]


def test_trl_beta_zero_is_a_constant_zero_coefficient(tmp_path):
    """TRL's default beta=0.0 (no KL term) reads as kl_coef=0 with kl_controller=constant and
    validates; a 2-step tiny run with --beta 0.0 logs kl_coef 0 at each step and still measures the
    KL (finite, and 0 at step 1 where policy and reference agree). beta=0 with another controller
    given is refused naming both. Before: refused with init_kl_coef's range."""
    import json

    cfg, notes = _notes({"beta": "0.0"})
    assert (cfg.kl_coef, cfg.kl_controller) == (0.0, "constant") and cfg.validate() is cfg
    assert len(notes) == 1 and "no KL term" in notes[0]
    with pytest.raises(ValueError, match=r"beta=0 \(TRL\) needs kl_controller=constant, got kl_controller=budget"):
        TrainConfig().override({"beta": 0, "kl_controller": "budget"})
    assert TrainConfig().override({"beta": 0.04}).kl_controller == "budget"  # only 0 implies constant
    run = tmp_path / "run"
    args = ["train", "--model", "tiny", "--beta", "0.0", "--steps", "2", "--prompts-per-step", "2",
            "--group-size", "2", "--max-new-tokens", "4", "--eval-size", "2", "--eval-max-new-tokens", "4",
            "--lora-rank", "0", "--learning-rate", "1e-3", "--out", str(run), "--quiet"]
    with pytest.warns(TRLNameNote):
        assert main(args) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["kl_coef"] for r in records] == [0.0, 0.0]
    assert records[0]["kl_per_seq"] == pytest.approx(0.0, abs=1e-6)
    assert all(r["kl_per_seq"] == r["kl_per_seq"] for r in records)


@pytest.mark.parametrize("name,value", [("use_vllm", False), ("logging_steps", 1), ("push_to_hub", "false"),
                                        ("fp16", False), ("top_p", 1.0), ("disable_dropout", True),
                                        ("vllm_importance_sampling_clip_min", 0.0), ("optim", "adamw_torch"),
                                        ("hub_model_id", None), ("vllm_importance_sampling_correction", False),
                                        ("vllm_gpu_memory_utilization", 0.9), ("remove_unused_columns", False),
                                        ("use_bias_correction_kl", True), ("log_completions_hub_repo", None)])
def test_trl_values_that_ask_for_what_tether_does_are_accepted(name, value):
    """A TRL setting without a tether key, at a value that asks for what tether does anyway, is
    accepted with one note and changes nothing. Before: refused as having no tether equivalent."""
    cfg, notes = _notes({name: value})
    assert cfg == TrainConfig()
    assert len(notes) == 1 and notes[0].startswith(f"TRL's {name}={value} asks for what tether does (")


@pytest.mark.parametrize("values,match", [
    ({"use_vllm": True}, r"use_vllm \(a TRL GRPOConfig name\) has no tether equivalent: tether samples"),
    ({"logging_steps": 10}, "no tether equivalent: tether logs every step"),
    ({"push_to_hub": True}, r"push_to_hub .*tether export RUN OUT --push-to-hub REPO"),
    ({"hub_model_id": "me/model"}, r"hub_model_id .*tether export RUN OUT --push-to-hub HUB_MODEL_ID"),
    ({"vllm_importance_sampling_mode": "sequence_mask"},
     r"vllm_importance_sampling_mode \(TRL, -> importance_correction\): expected one of \['token_mask', "
     r"'token_truncate'\], got 'sequence_mask'"),
    ({"vllm_importance_sampling_clip_min": 0.5}, "no tether equivalent: .*only an upper threshold, importance_cap"),
    ({"off_policy_mask_threshold": 0.5}, "off_policy_mask_threshold .*no tether equivalent: DeepSeek-V3.2"),
    ({"shuffle_dataset": False}, "shuffle_dataset .*pure function of \\(seed, step\\)"),
])
def test_trl_values_tether_cannot_honour_name_what_to_use(values, match):
    """The same names at values tether cannot honour stay refused, pointing at what to use (the
    export command for the hub; importance_cap for the clip). Before: push_to_hub and
    hub_model_id got "no close match", the importance-sampling mode and clip_min a hint at the
    deprecated vllm_importance_sampling_cap."""
    with pytest.raises(ValueError, match=match):
        TrainConfig().override(values)


def test_trl_importance_sampling_mode_maps_to_importance_correction():
    """TRL 1.16's token-level modes are tether's per-token weights: token_truncate -> tis,
    token_mask -> mis; with vllm_importance_sampling_clip_max as the cap."""
    for mode, want in (("token_truncate", "tis"), ("token_mask", "mis")):
        cfg, notes = _notes({"vllm_importance_sampling_mode": mode, "vllm_importance_sampling_clip_max": 3.0})
        assert (cfg.importance_correction, cfg.importance_cap) == (want, 3.0) and len(notes) == 2
        cfg.validate()
