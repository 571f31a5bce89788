"""TRL's ``GRPOConfig`` names for tether's config keys: a user coming from TRL writes ``beta: 0.04``.

``TRL_NAMES`` says, for each common TRL name, which ``TrainConfig`` key holds the same setting
(with the value translated where the vocabularies differ, e.g. ``loss_type`` -> ``aggregation``),
or why tether has no such key and what to use instead. ``translate`` applies the table to a
mapping of config keys: mapped names become tether keys and yield a one-line note each; names
without an equivalent, untranslatable values, and a TRL name given together with its tether key
are problems for the caller to raise. Names that are already tether keys (``learning_rate``,
``temperature``, ``seed``, ...) never reach it. No TRL install is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any


class TRLNameNote(UserWarning):
    """A TRL config name was read as the tether key that holds the same setting."""


@dataclass(frozen=True)
class TRLName:
    """One TRL name: the tether key it maps to (``None``: no equivalent) and a note.

    ``values`` translates TRL values to tether values (keys compared lower-cased as text,
    so ``True``, ``"true"`` and ``"True"`` are one key); ``None`` passes the value through.
    """

    target: str | None
    note: str
    values: Mapping[str, Any] | None = None
    switch: bool = False  # a TRL boolean: a bare --flag on the command line means true
    # Values (lower-cased text) of a name with no tether key that ask for what tether does anyway:
    # accepted with a note instead of refused.
    accepted: tuple[str, ...] = ()
    # Further tether keys a value sets (TRL's beta=0 also means a constant coefficient).
    implies: Callable[[Any], dict[str, Any]] | None = None


_YES, _NO = ("true", "1", "yes"), ("false", "0", "no")
_UNSET = ("none", "null", "")  # YAML's null, or a TRL default of None given explicitly
_ANY = ("*",)  # settings TRL reads only for a feature tether refuses elsewhere (vLLM, loss_type=sapo): inert


def _no_kl(value: Any) -> dict[str, Any]:
    """TRL's ``beta=0`` drops the KL term: tether keeps the coefficient at 0 (constant controller)."""
    try:
        return {"kl_controller": "constant"} if float(value) == 0 else {}
    except (TypeError, ValueError):
        return {}  # the conversion to kl_coef's type reports the value


def _flag(on: Any, off: Any) -> dict[str, Any]:
    return {**dict.fromkeys(_YES, on), **dict.fromkeys(_NO, off)}


_FULL_SOFTMAX = ("tether samples from softmax(logits / temperature) untruncated, so the sampling "
                 "log-probs are the scored policy's own; only temperature is a sampling knob")
_ONE_ROLLOUT = ("each step samples one batch of prompts_per_step x group_size answers; reuse it for "
                "several updates with updates_per_rollout")

TRL_NAMES: dict[str, TRLName] = {
    # --- same setting, another name
    "beta": TRLName("kl_coef", "TRL's beta is a constant coefficient, while tether's default kl_controller=budget "
                    "starts from this value and moves it every step to hold the KL at kl_target; pass "
                    "--kl-controller constant to keep TRL's meaning. TRL's k3 KL term in the loss is tether's "
                    "default kl_mode=loss, kl_estimator=k3. beta=0 (TRL's default, no KL term) sets "
                    "kl_controller=constant: the coefficient stays 0 and the KL is still measured and logged",
                    implies=_no_kl),
    "num_generations": TRLName("group_size", "answers sampled per prompt"),
    "max_completion_length": TRLName("max_new_tokens", "response length limit"),
    "num_iterations": TRLName("updates_per_rollout", "updates per sampled batch (mu)"),
    "per_device_train_batch_size": TRLName(
        "micro_batch_size", "sequences per forward/backward; a step's batch is prompts_per_step x group_size "
        "sequences, accumulated micro_batch_size at a time"),
    "epsilon": TRLName("clip_epsilon", "lower (and, without clip_epsilon_high, upper) clip range"),
    "epsilon_high": TRLName("clip_epsilon_high", "upper clip range (clip-higher)"),
    "loss_type": TRLName(
        "aggregation", "tether's token-mean divides by the tokens of the whole step's batch (DAPO); "
        "dr_grpo divides by max_new_tokens per answer",
        {"grpo": "seq-mean-token-mean", "dapo": "token-mean", "bnpo": "token-mean",
         "dr_grpo": "seq-mean-token-sum-norm"}),
    "scale_rewards": TRLName(
        "advantage", "group z-score is advantage=grpo, no scaling (Dr. GRPO) is advantage=dr_grpo",
        {**_flag("grpo", "dr_grpo"), "group": "grpo", "none": "dr_grpo"}),
    "importance_sampling_level": TRLName("ratio_level", "token (PPO/GRPO) or sequence (GSPO) ratio",
                                         {"token": "token", "sequence": "sequence"}),
    "vllm_importance_sampling_clip_max": TRLName("importance_cap", "cap of the tis/mis sampler-mismatch weights"),
    "vllm_importance_sampling_cap": TRLName("importance_cap", "cap of the tis/mis sampler-mismatch weights (TRL's "
                                            "older name for vllm_importance_sampling_clip_max)"),
    "max_steps": TRLName("steps", "optimizer steps"),
    "save_steps": TRLName("checkpoint_every", "steps between checkpoints"),
    "save_total_limit": TRLName("keep_checkpoints", "newest checkpoints kept"),
    "output_dir": TRLName("out", "run directory"),
    "eval_steps": TRLName("eval_every", "steps between held-out evaluations"),
    "max_grad_norm": TRLName("grad_clip", "global gradient-norm clip"),
    "lr_scheduler_type": TRLName("lr_schedule", "schedule after warmup_steps of linear warm-up",
                                 {"constant": "constant", "constant_with_warmup": "constant",
                                  "linear": "linear", "cosine": "cosine"}),
    "bf16": TRLName("dtype", "weights in bfloat16; vocabulary reductions and LoRA factors stay float32",
                    _flag("bfloat16", "float32"), switch=True),
    "torch_dtype": TRLName("dtype", "weights' dtype", {"bfloat16": "bfloat16", "float32": "float32"}),
    "use_cpu": TRLName("device", "device=auto takes a GPU when there is one", _flag("cpu", "auto"), switch=True),
    "sync_ref_model": TRLName("reference_update", "TR-DPO mixing every reference_every steps is reference_update=ema",
                              _flag("ema", "fixed"), switch=True),
    "ref_model_mixup_alpha": TRLName("reference_alpha", "weight of the policy in the reference mix"),
    "ref_model_sync_steps": TRLName("reference_every", "steps between reference updates"),
    "model_name_or_path": TRLName("model", "a local directory or a hub id already in the local cache"),
    "dataset_name": TRLName("dataset", "a local file or saved datasets directory; nothing is downloaded"),
    "lora_r": TRLName("lora_rank", "LoRA rank (0 trains every weight)"),
    "lora_target_modules": TRLName("lora_targets", "comma-separated module names"),
    # --- no equivalent: what to use instead
    "gradient_accumulation_steps": TRLName(None, "tether accumulates over the whole step's batch of "
                                           "prompts_per_step x group_size sequences, micro_batch_size at a "
                                           "time; set prompts_per_step and micro_batch_size"),
    "num_train_epochs": TRLName(None, "tether counts optimizer steps; set steps"),
    "logging_steps": TRLName(None, "tether logs every step to metrics.jsonl", accepted=("1",)),
    "fp16": TRLName(None, "float16 training needs loss scaling, which tether does not do; use dtype=bfloat16",
                    switch=True, accepted=_NO),
    "delta": TRLName(None, "the two-sided clip bound (INTELLECT-2) has no tether equivalent; dual_clip is "
                     "the PPO dual clip, a bound on negative-advantage tokens", accepted=_UNSET),
    "top_p": TRLName(None, _FULL_SOFTMAX, accepted=("1", "1.0")),
    "top_k": TRLName(None, _FULL_SOFTMAX, accepted=("0", "-1", *_UNSET)),
    "min_p": TRLName(None, _FULL_SOFTMAX, accepted=("0", "0.0", *_UNSET)),
    "repetition_penalty": TRLName(None, _FULL_SOFTMAX, accepted=("1", "1.0")),
    "generation_batch_size": TRLName(None, _ONE_ROLLOUT, accepted=_UNSET),
    "steps_per_generation": TRLName(None, _ONE_ROLLOUT, accepted=("1", *_UNSET)),
    "use_vllm": TRLName(None, "tether samples with its own KV-cache sampler, in-process or on Ray workers "
                        "(workers=N)", switch=True, accepted=_NO),
    "mask_truncated_completions": TRLName(None, "truncated answers stay in the loss; raise max_new_tokens",
                                          switch=True, accepted=_NO),
    "top_entropy_quantile": TRLName(None, "every response token is in the loss", accepted=("1", "1.0")),
    "max_prompt_length": TRLName(None, "prompts are never truncated", accepted=_UNSET),
    "model_init_kwargs": TRLName(None, "use model, dtype and device", accepted=_UNSET),
    "disable_dropout": TRLName(None, "dropout is always off: the policy and reference run in eval mode",
                               switch=True, accepted=_YES),
    "cast_lm_head_to_fp32": TRLName(None, "log-softmax, entropy and KL over the vocabulary always run in "
                                    "float32", switch=True, accepted=_YES),
    "gradient_checkpointing_kwargs": TRLName(None, "gradient_checkpointing uses non-reentrant checkpointing "
                                             "and takes no options", accepted=_UNSET),
    "log_completions": TRLName(None, "use log_completions_every=K", switch=True, accepted=_NO),
    "num_completions_to_print": TRLName(None, "use log_completions_every=K", accepted=_UNSET),
    "warmup_ratio": TRLName(None, "use warmup_steps (= warmup_ratio x steps)", accepted=("0", "0.0")),
    "eval_strategy": TRLName(None, "use eval_every=K", accepted=("no",)),
    "vllm_importance_sampling_correction": TRLName(None, "use importance_correction=tis or mis", switch=True,
                                                   accepted=_NO),
    "vllm_importance_sampling_mode": TRLName(
        "importance_correction", "tether's sampler-mismatch weights are per token, truncated (tis) or masked "
        "(mis) at importance_cap; TRL's sequence_* modes weigh whole answers and have no tether equivalent",
        {"token_truncate": "tis", "token_mask": "mis"}),
    "vllm_importance_sampling_clip_min": TRLName(
        None, "tether's tis/mis weights have only an upper threshold, importance_cap (TRL's "
        "vllm_importance_sampling_clip_max)", accepted=("0", "0.0", *_UNSET)),
    "multi_objective_aggregation": TRLName(None, "rewards are summed with reward_weights, then turned into "
                                           "group advantages (TRL's sum_then_normalize)",
                                           accepted=("sum_then_normalize",)),
    "resume_from_checkpoint": TRLName(None, "use tether train --resume RUN_DIR", accepted=(*_NO, *_UNSET)),
    "optim": TRLName(None, "the optimizer is AdamW (learning_rate, weight_decay)",
                     accepted=("adamw_torch", "adamw_torch_fused")),
    "use_peft": TRLName(None, "LoRA is on unless lora_rank=0; --adapter PATH continues an existing adapter",
                        switch=True),
    "push_to_hub": TRLName(None, "tether train uploads nothing; push a run's model with tether export RUN OUT "
                           "--push-to-hub REPO", switch=True, accepted=_NO),
    "hub_model_id": TRLName(None, "give it to tether export RUN OUT --push-to-hub HUB_MODEL_ID after training",
                            accepted=_UNSET),
    "hub_strategy": TRLName(None, "tether export RUN OUT --push-to-hub REPO pushes the exported model once",
                            accepted=("end", *_UNSET)),
    "remove_unused_columns": TRLName(None, "every dataset column reaches the reward functions", accepted=_NO),
    "num_generations_eval": TRLName(None, "each held-out prompt is answered once, greedily", accepted=_UNSET),
    "shuffle_dataset": TRLName(None, "training problems are drawn from the data by a pure function of (seed, step)",
                               accepted=_YES),
    "ds3_gather_for_generation": TRLName(None, "no DeepSpeed: a sharded learner (--nproc) gathers the weights to "
                                         "sample", switch=True, accepted=_YES),
    "generation_kwargs": TRLName(None, _FULL_SOFTMAX, accepted=_UNSET),
    "chat_template_kwargs": TRLName(None, "prompts are rendered with the tokenizer's chat template as it is "
                                    "(prompt_format=text feeds them unrendered)", accepted=_UNSET),
    "use_transformers_paged": TRLName(None, "tether samples with its own KV-cache sampler", switch=True,
                                      accepted=_NO),
    "cache_implementation": TRLName(None, "tether samples with its own KV-cache sampler", accepted=_UNSET),
    **{name: TRLName(None, "there is no vLLM in tether (see use_vllm); TRL reads this only with use_vllm=true, "
                     "so any value is inert", accepted=_ANY)
       for name in ("vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
                    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
                    "vllm_group_port", "vllm_gpu_memory_utilization", "vllm_max_model_length",
                    "vllm_tensor_parallel_size")},
    **{name: TRLName(None, "TRL reads it only with loss_type=sapo, which has no tether equivalent; inert",
                     accepted=_ANY) for name in ("sapo_temperature_neg", "sapo_temperature_pos")},
    "max_tool_calling_iterations": TRLName(None, "the tool task's turns are limited by max_turns "
                                           "(--task arithmetic-tools)", accepted=_UNSET),
    "off_policy_mask_threshold": TRLName(None, "DeepSeek-V3.2's off-policy sequence mask has no tether "
                                         "equivalent; importance_correction=mis masks per token", accepted=_UNSET),
    "use_bias_correction_kl": TRLName(None, "tether's KL loss term is always importance-weighted by the sampler's "
                                      "log-probs, so its gradient stays unbiased off-policy", switch=True,
                                      accepted=_YES),
    "log_unique_prompts": TRLName(None, "use log_completions_every=K", switch=True, accepted=_NO),
    "log_completions_hub_repo": TRLName(None, "logged completions go to completions.jsonl and the trackers; tether "
                                        "uploads nothing", accepted=_UNSET),
    "hub_private_repo": TRLName(None, "create the repo private before tether export --push-to-hub pushes to it",
                                switch=True, accepted=(*_NO, *_UNSET)),
}


@dataclass
class Translation:
    """``translate``'s result: the mapping in tether keys, the notes, and the problems."""

    values: dict[str, Any]
    notes: list[str]
    problems: list[str]
    renamed: dict[str, str]  # tether key -> the TRL name it was given as


def _translate_one(name: str, entry: TRLName, raw: Any, fields: Collection[str]) -> tuple[Any, str]:
    """``(tether value, note)``; raises ``ValueError`` with the problem."""
    if entry.target is None and (entry.accepted == _ANY or str(raw).strip().lower() in entry.accepted):
        return None, f"TRL's {name}={raw} asks for what tether does ({entry.note})"
    if entry.target is None:
        raise ValueError(f"{name} (a TRL GRPOConfig name) has no tether equivalent: {entry.note}")
    if entry.target not in fields:
        raise ValueError(f"{name} (TRL) corresponds to tether's {entry.target}, which this tether version lacks")
    value = raw
    if entry.values is not None:
        text = str(raw).lower()
        if text not in entry.values:
            raise ValueError(f"{name} (TRL, -> {entry.target}): expected one of {sorted(set(entry.values))}, got "
                             f"{raw!r}; other values have no tether equivalent")
        value = entry.values[text]
    return value, f"TRL's {name}={raw} read as {entry.target}={value} ({entry.note})"


def translate(values: Mapping[str, Any], fields: Collection[str],
              table: Mapping[str, TRLName] = TRL_NAMES) -> Translation:
    """Replace TRL names in ``values`` by the tether keys in ``fields`` that hold the same setting.

    Keys that are tether fields, or neither fields nor TRL names, pass through unchanged (the
    caller reports unknown keys). A TRL name and its tether key in the same mapping, or two
    TRL names for one key, are a problem rather than a silent choice.
    """
    out: dict[str, Any] = {k: v for k, v in values.items() if k in fields or k not in table}
    notes, problems = [], []
    source: dict[str, str] = {k: k for k in out}
    for name, raw in values.items():
        if name in out or name not in table:
            continue
        try:
            value, note = _translate_one(name, table[name], raw, fields)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        target, implies = table[name].target, table[name].implies
        if target is None:  # a value that asks for what tether does: nothing to set
            notes.append(note)
            continue
        if target in source:
            problems.append(f"{name} (TRL name for {target}) and {source[target]} both given; keep one")
            continue
        out[target], source[target] = value, name
        notes.append(note)
        for key, implied in (implies(raw) if implies else {}).items():
            if key in source and str(out[key]) != str(implied):
                problems.append(f"{name}={raw} (TRL) needs {key}={implied}, got {key}={out[key]}; drop {key}, or "
                                f"give {target} instead of {name}")
            elif key not in source:
                out[key], source[key] = implied, name
    renamed = {target: name for target, name in source.items() if target != name}
    return Translation(out, notes, problems, renamed)

