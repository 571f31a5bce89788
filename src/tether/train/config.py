"""``TrainConfig``: the one flat configuration of ``tether train``.

Every field carries its help text in ``metadata["help"]``; the CLI builds its flags and
``--help`` from them, YAML files use the field names as keys, and ``key=value`` overrides
apply on top. ``validate()`` reports every problem at once in a single ``ValueError``.
TRL's ``GRPOConfig`` names for the same keys are read through ``tether.integrations.trl``.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections import ChainMap
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from tether.integrations.trl import TRL_NAMES, TRLNameNote, translate
from tether.ops.checks import lookup, problems, real_number, whole_number


def _f(default: Any, help: str, **choices: Any) -> Any:
    return field(default=default, metadata={"help": help, **choices})


@dataclass
class TrainConfig:
    """GRPO with a KL leash; defaults are tuned for the embedded model on 2 CPU cores."""

    # --- run
    model: str = _f("default", "Policy: 'default' (embedded SmolLM2-135M-Instruct), 'tiny' (2-layer random model for smoke runs), a local HF model directory, or a hub id already in the local HF cache (nothing is downloaded).")
    adapter: str = _f("", "Directory of a PEFT LoRA adapter of the model to continue training (its rank, alpha and targets replace lora_*); the reference is the model with this adapter as loaded.")
    dtype: str = _f("float32", "Weights' dtype: float32 or bfloat16 (vocabulary reductions and LoRA factors stay float32).")
    device: str = _f("auto", "auto (cuda when a GPU is visible, else cpu), cpu or cuda (refused without a GPU).")
    gradient_checkpointing: bool = _f(False, "Recompute each decoder layer's activations in backward instead of storing them (less memory, about a third more compute).")
    host_mmap_threshold: int = _f(1 << 20, "CPU runs on glibc: blocks of at least this many bytes (<= 32 MiB) are mapped from and returned to the OS when freed, so what a stage freed does not stay resident into the next (the default step's peak fell by a fifth; docs/performance.md); 0 keeps glibc's adaptive threshold.")
    task: str = _f("arithmetic", "Task name from the registry, or a path to a .py file defining TASK or make_task().")
    steps: int = _f(16, "Number of optimizer steps.")
    seed: int = _f(0, "Seed for data, sampling and initialisation.")
    out: str = _f("runs/train", "Run directory (config.yaml, metrics.jsonl, plots/, checkpoints/, summary.json).")
    checkpoint_every: int = _f(4, "Save a checkpoint every K steps (and at the end); 0 saves only at the end.")
    keep_checkpoints: int = _f(2, "Checkpoints kept (the newest ones); resume falls back to the newest intact one.")
    overwrite: bool = _f(False, "Replace the run in --out (its config, metrics, plots, summary and checkpoints); without it a directory that is not empty is refused.")
    workers: int = _f(0, "Rollout workers on Ray sharing one ReferenceService; 0 samples in-process.")
    ray_address: str = _f("", "Address of an existing Ray cluster; empty starts a local one bound to 127.0.0.1.")
    ray_timeout: float = _f(600.0, "Seconds any wait on Ray may last (connecting, actors starting, a step's rollouts) before the run fails.")
    threads: int = _f(0, "torch intra-op threads; 0 keeps torch's default.")
    nproc: int = _f(1, "Learner processes: N > 1 relaunches under torch.distributed.run and shards the policy with FSDP2 (gloo on CPU, NCCL on CUDA); each rank samples prompts_per_step / N groups.")
    # --- rollout
    prompts_per_step: int = _f(12, "Distinct prompts per step.")
    group_size: int = _f(6, "Completions sampled per prompt (G).")
    max_new_tokens: int = _f(20, "Response length limit during training.")
    temperature: float = _f(1.0, "Sampling temperature (also used for every log-prob).")
    max_turns: int = _f(0, "Tool tasks: most assistant messages per episode (the last one's tool calls are not run); 0 keeps the task's own (arithmetic-tools: 3). Refused for a single-turn task.")
    max_episode_tokens: int = _f(0, "Tool tasks: most tokens a conversation may hold (prompt, every message and tool result); the episode ends there, its answer marked truncated. 0 keeps the task's own (arithmetic-tools: 512). Refused for a single-turn task.")
    # --- optimisation
    learning_rate: float = _f(2e-4, "AdamW learning rate.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this value; 0 disables.")
    micro_batch_size: int = _f(24, "Sequences per forward/backward pass (gradient accumulation over the step's batch).")
    lora_rank: int = _f(16, "LoRA rank; 0 fine-tunes every weight.")
    lora_alpha: float = _f(32.0, "LoRA alpha (scaling = alpha / rank).")
    lora_targets: str = _f("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "Comma-separated module names that get LoRA adapters.")
    # --- loss
    clip_epsilon: float = _f(0.2, "PPO clip epsilon (low side, and high side unless clip_epsilon_high is set).")
    clip_epsilon_high: float = _f(0.0, "Upper clip epsilon for clip-higher; 0 uses clip_epsilon.")
    aggregation: str = _f("token-mean", "Loss reduction: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm.")
    advantage: str = _f("grpo", "Group advantage: grpo (z-score), dr_grpo (mean only), rloo (leave-one-out).")
    entropy_coeff: float = _f(0.0, "Entropy bonus coefficient; 0 disables the bonus (entropy is still logged).")
    ratio_level: str = _f("token", "Importance ratio per token (PPO/GRPO) or per sequence, length-normalised (GSPO): token, sequence.")
    trust_region: str = _f("clip", "Trust region to the sampling policy, cutting a token's policy gradient: clip (PPO's ratio clip at clip_epsilon), dppo_tv / dppo_kl (DPPO's masks: the sampled token's probability shift p - q, or the Bernoulli KL(q || p), past trust_region_delta in the advantage's direction) or none.")
    trust_region_delta: float = _f(0.2, "DPPO threshold (low side, and high side unless trust_region_delta_high is set): a probability shift in (0, 1) for dppo_tv, nats for dppo_kl.")
    trust_region_delta_high: float = _f(0.0, "Upper DPPO threshold; 0 uses trust_region_delta.")
    dual_clip: float = _f(0.0, "Dual-clip constant c > 1 bounding the loss of negative-advantage tokens at -c*A; 0 disables.")
    importance_correction: str = _f("none", "Sampler/trainer mismatch weights: none, tis (truncated) or mis (masked) at importance_cap.")
    importance_cap: float = _f(2.0, "Threshold of the tis/mis importance weights (> 0).")
    # --- loop
    updates_per_rollout: int = _f(1, "Optimizer steps per rollout: the step's batch is cut into this many mini-batches, each one update; later ones are off-policy (clip, ESS and the importance-weighted KL act).")
    lr_schedule: str = _f("constant", "Learning-rate schedule over the steps after warm-up: constant, linear (to 0) or cosine (to 0).")
    warmup_steps: int = _f(0, "Steps of linear warm-up: step s < K uses (s + 1) / (K + 1) of learning_rate.")
    eval_every: int = _f(0, "Score the held-out set every K steps (logged as eval_accuracy) and keep the best checkpoint in best/; 0 disables.")
    dynamic_sampling: bool = _f(False, "DAPO's dynamic sampling: draw the step's prompts again until prompts_per_step groups have rewards that differ (logged: groups_drawn, groups_kept); equal-reward groups fill up what max_resample draws did not find.")
    max_resample: int = _f(4, "Extra draws of prompts_per_step prompts a step may make under dynamic_sampling.")
    # --- tracking
    report_to: str = _f("none", "Trackers besides metrics.jsonl, comma-separated or the flag repeated: tensorboard (RUN/tensorboard/), wandb (RUN/wandb/; WANDB_MODE=offline needs no network), mlflow (MLFLOW_TRACKING_URI or RUN/mlflow.db); none for none.")
    log_completions_every: int = _f(0, "Every K steps write a few prompt/completion/reward rows to completions.jsonl (and TensorBoard text); 0 disables.")
    # --- KL leash
    kl_mode: str = _f("loss", "'loss': gradient-correct KL term in the loss; 'reward': k1 per-token penalty in the reward with reward-to-go; 'exact': the exact full-vocabulary KL per token as the loss term (kl_signal=exact; no sampling noise over the vocabulary, each token's context held fixed).")
    kl_estimator: str = _f("k3", "Estimator of the KL loss term (k2 or k3); the reward mode always uses k1.")
    kl_correction: str = _f("importance", "The KL loss term's form: 'importance' (w = pi / pi_sampler in the graph: k3 gives w x k3, k2 gives sg(w) x k2, whose gradient w x k1 x grad log pi is OpenRLHF's unbiased one; both have the reverse KL's expected gradient) or 'none' (the raw estimator, the GRPO paper's k3, whose expected gradient is the forward KL's).")
    kl_coef: float = _f(0.2, "KL coefficient beta: the constant one, or the start of an adaptive, target or budget controller.")
    kl_controller: str = _f("budget", "'budget' (after each update measures the KL on the step's answers and, outside 0.75-1.125 x kl_target, moves the weights along the line to the reference back to kl_target; beta adapts slowly from kl_coef), 'target' (moves beta every step to hold the KL at kl_target; kl_coef is its start), 'constant' (beta = kl_coef) or 'adaptive' (Ziegler et al. 2019) control of beta.")
    kl_target: float = _f(3.0, "KL the target or adaptive controller aims at: mean per-sequence summed KL (nats per answer).")
    kl_horizon: int = _f(2000, "Adaptive controller horizon, in sequences.")
    kl_signal: str = _f("exact", "KL that kl_bound and the summary read: 'exact' (full-vocabulary KL at the answer tokens, computed in the loss pass from the reference's hidden states: two head projections, no extra forward) or 'sampled' (k1 along the sampled answers). Both are logged (kl_exact_* and kl_*); Ray runs and soft-capped heads have only the sampled one.")
    kl_control_signal: str = _f("sampled", "KL the controller reads: 'sampled' (k1 of the batch about to be trained on, known before its update: beta acts one step sooner) or 'exact' (the full-vocabulary KL from the loss pass, known after the update: less noise, one step later). Sampled suits batches of dozens of answers or more; exact suits small noisy batches. kl_controller=budget reads neither: it measures the updated weights.")
    kl_bound: float = _f(4.0, "Ceiling on the KL per answer (nats) of the weights kept: after every update they are read on the step's answers (kl_kept_per_seq) and, above it, pulled back along the line to the reference, whatever the controller; 0 turns the ceiling off (kl_over_bound then never set).")
    kl_push: bool = _f(False, "kl_controller=budget: whether a KL lagging under the band is pushed up by scaling the update out (up to kl_max_scale); off, the budget only pulls back and a lagging KL rises as the gradient and the released beta carry it (the leash page has the measurements behind the default).")
    kl_band: float = _f(0.25, "kl_controller=budget: half-width of the band as a fraction of kl_target; the weights move when the KL leaves [1 - kl_band, 1 + kl_band / 2] x kl_target and a search keeps at most (1 + kl_band) x kl_target, which must not exceed kl_bound.")
    kl_max_scale: float = _f(4.0, "kl_controller=budget with kl_push: the largest factor a push may scale the update by (>= 1).")
    kl_max_forwards: int = _f(4, "kl_controller=budget: most KL readings a step's search spends (>= 2); a search that finds nothing under the band's top rejects the update (step_rejected).")
    reference_update: str = _f("fixed", "Reference policy: fixed, sync (hard copy every reference_every steps) or ema.")
    reference_every: int = _f(10, "Steps between reference updates (sync / ema).")
    reference_alpha: float = _f(0.1, "EMA mixing weight for reference_update=ema.")
    reference_move: str = _f("off", "kl_controller=budget: advance the reference when the budget binds, after reference_move_after pulled-back (scaled under 1 or rejected) steps in a row: 'reset' copies the kept weights into it, 'ema' moves it reference_move_alpha of the way; the kept weights' KL per answer to the original model is then held under reference_move_budget. 'off' never moves it. With LoRA only 'reset' (it copies the adapter); with reference_update=fixed.")
    reference_move_after: int = _f(3, "reference_move: consecutive pulled-back steps that move the reference.")
    reference_move_alpha: float = _f(0.5, "reference_move=ema: the kept weights' share in each move of the reference, in (0, 1].")
    kl_adaptive_lr: bool = _f(False, "kl_controller=budget: scale the next step's learning rate by the scale the budget kept (to the power kl_adaptive_lr_gain; a rejected update halves it) and raise it by 1.5x (to the same power) after a step it did not pull back, never above the schedule's rate.")
    kl_adaptive_lr_gain: float = _f(1.0, "kl_adaptive_lr: the power on each factor, in (0, 1]; 1 follows the kept scale in one step.")
    reference_move_budget: float = _f(8.0, "reference_move: ceiling on the kept weights' KL per answer (nats) to the original model, held after the reference has moved by pulling them back along the line to the original; at least kl_bound.")
    weight_average: float = _f(0.0, "Decay mu of a running exponential average of the kept trainable weights, updated after every step's leash (avg <- mu avg + (1 - mu) kept, starting at the initial weights); after the last step the average replaces the weights (WARP's averaging) and, with kl_controller=budget or kl_bound, is pulled back along the line to the reference when over the band's upper edge (1 + kl_band / 2) x kl_target or the ceiling. 0 off; in [0, 1).")
    final_kl_target: float = _f(0.0, "After the last step (and the average), move the weights to theta_0 + lambda (theta_T - theta_0), lambda in [0, 1] found by the budget's line search so the KL per answer on the last step's answers lands at or under this target (WiSE-FT / WARP's interpolation; lambda and the KL go to the summary as final_interpolation, final_kl_per_seq). 0 off; at most kl_bound.")
    # --- data and rewards (tether.train.tasks, tether.train.rewards)
    dataset: str = _f("", "Prompts from a .jsonl/.csv/.parquet file, a save_to_disk directory or a Hub dataset id in the local Hugging Face cache (its train split), read offline with `datasets`, instead of --task.")
    prompt_column: str = _f("prompt", "Dataset column holding each prompt: chat messages or plain text; the other columns reach the reward functions.")
    prompt_format: str = _f("chat", "'chat' renders prompts with the chat template (text becomes one user turn); 'text' feeds plain text as is (base models).")
    eval_dataset: str = _f("", "Held-out prompts from this file, directory or cached Hub dataset id (same formats as --dataset).")
    eval_split: float = _f(0.0, "Hold out this fraction of --dataset's rows (a fixed shuffle, never trained on); 0 holds out none.")
    reward_funcs: str = _f("", "A .py file of reward functions f(prompts, completions, **columns) -> list[float | None] (TRL's convention); runs its code.")
    reward_weights: str = _f("", "Comma-separated weights of the reward functions, in order (the reward model last); empty weighs each 1.")
    reward_model: str = _f("", "A local sequence-classification model directory whose end score is one more reward.")
    # --- evaluation
    eval_size: int = _f(150, "Held-out problems scored before and after training (greedy decoding).")
    eval_max_new_tokens: int = _f(20, "Response length limit for evaluation.")

    # ------------------------------------------------------------------ helpers
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        """Build from a mapping of field names (YAML keys); unknown keys are errors."""
        return cls().override(values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "TrainConfig":
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ValueError(f"{path}: cannot read the config file ({exc.strerror}); check the path.") from exc
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise ValueError(f"{path}: not valid YAML ({problem}{where}); fix the file's syntax.") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a YAML mapping of config keys, got {type(data).__name__}.")
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def override(self, values: dict[str, Any]) -> "TrainConfig":
        """A copy with ``values`` (raw strings or typed values) converted to each field's type."""
        types = {f.name: type(f.default) for f in fields(self)}
        trl = translate(values, types)
        problems, updates = list(trl.problems), {}
        for key, raw in trl.values.items():
            if key not in types:
                problems.append(_unknown_key(key, types))
                continue
            if key in LIST_FIELDS and isinstance(raw, (list, tuple)):  # YAML's list, TRL's report_to=[...]
                raw = ",".join(map(str, raw))
            try:
                updates[key] = _convert(raw, types[key])
            except ValueError:
                name = f"{key} (TRL's {trl.renamed[key]})" if key in trl.renamed else key
                problems.append(f"{name}: expected {types[key].__name__}, got {raw!r}")
        if problems:
            raise ValueError("config: " + "; ".join(problems))
        for note in trl.notes:
            warnings.warn(note, TRLNameNote, stacklevel=2)
        return dataclasses.replace(self, **updates)

    def to_yaml(self) -> str:
        return yaml.safe_dump(dataclasses.asdict(self), sort_keys=False)

    @property
    def reference_moves(self) -> bool:
        """Whether anything moves the reference (``reference_update`` or ``reference_move``), so
        it needs weights of its own."""
        return self.reference_update != "fixed" or self.reference_move != "off"

    def validate(self) -> "TrainConfig":
        """Raise one ValueError listing every invalid field, or return self."""
        p: list[str] = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                p.append(msg)

        ranges = {**_RANGES, **({"lora_alpha": {"low": 0, "low_open": True}} if self.lora_rank else {})}
        for f in fields(self):  # every number field: its type, finiteness and range
            if f.type in ("int", "float"):
                check = whole_number if f.type == "int" else real_number
                p.extend(problems(check, f.name, getattr(self, f.name), **ranges.get(f.name, {})))
        for name, table in config_choices().items():
            value = getattr(self, name)
            for one in value.split(",") if name in LIST_FIELDS and value.strip() else [value]:
                try:
                    lookup(table, one.strip(), name)
                except ValueError as exc:
                    p.append(str(exc))
        need(self.kl_control_signal != "exact" or self.kl_signal == "exact",
             "kl_control_signal: 'exact' needs kl_signal='exact' (the exact KL is computed only then); "
             f"got kl_signal={self.kl_signal!r}: set both to 'exact' or the controller to 'sampled'")
        if self.kl_mode == "loss":
            need(self.kl_estimator in ("k2", "k3"), f"kl_estimator: kl_mode='loss' needs k2 or k3, got {self.kl_estimator!r}")
        need(self.kl_mode != "exact" or self.kl_signal == "exact",
             f"kl_mode: 'exact' needs kl_signal='exact' (the reference's hidden states), got {self.kl_signal!r}")
        need(not (self.lora_rank and self.reference_update == "ema"),
             "reference_update: 'ema' is not defined for LoRA policies (mixing the low-rank factors "
             "does not mix the adapted weights); use 'sync' or lora_rank=0")
        p.extend(_reference_move_problems(self))
        p.extend(_finish_problems(self))
        p.extend(_loop_problems(self))
        p.extend(_task_problem(self.task))
        p.extend(_data_problems(self))
        p.extend(_sharding_problems(self))
        if p:
            raise ValueError("invalid configuration:\n  - " + "\n  - ".join(p))
        return self


# The range of each number field beyond "a finite number" (ints: at least ``low``).
_RANGES: dict[str, dict[str, Any]] = {
    **{name: {"low": 1} for name in ("steps", "prompts_per_step", "max_new_tokens", "micro_batch_size",
                                     "eval_max_new_tokens", "kl_horizon", "reference_every", "keep_checkpoints",
                                     "reference_move_after")},
    "group_size": {"low": 2, "fix": "A group of one has no baseline."},
    **{name: {"low": 0} for name in ("checkpoint_every", "workers", "threads", "lora_rank", "eval_size",
                                     "weight_decay", "grad_clip", "entropy_coeff", "kl_coef", "clip_epsilon_high",
                                     "warmup_steps", "eval_every", "log_completions_every", "max_turns", "max_resample",
                                     "max_episode_tokens", "trust_region_delta_high")},
    **{name: {"low": 0, "low_open": True} for name in ("learning_rate", "temperature", "kl_target", "importance_cap")},
    "kl_bound": {"low": 0, "fix": "0 turns the ceiling off."},
    "host_mmap_threshold": {"low": 0, "high": 32 << 20, "fix": "32 MiB is glibc's ceiling; 0 keeps its own threshold."},
    "kl_band": {"low": 0, "low_open": True, "high": 1, "high_open": True},
    "kl_max_scale": {"low": 1, "fix": "1 never pushes; or set kl_push=false."},
    "kl_max_forwards": {"low": 2, "fix": "One reads the updated weights, one a move."},
    "ray_timeout": {"low": 0, "low_open": True, "fix": "It is in seconds."},
    "clip_epsilon": {"low": 0, "low_open": True, "high": 1, "high_open": True},
    "trust_region_delta": {"low": 0, "low_open": True},
    "reference_alpha": {"low": 0, "low_open": True, "high": 1},
    "reference_move_alpha": {"low": 0, "low_open": True, "high": 1},
    "reference_move_budget": {"low": 0, "low_open": True},
    "kl_adaptive_lr_gain": {"low": 0, "low_open": True, "high": 1},
    "weight_average": {"low": 0, "high": 1, "high_open": True, "fix": "0 turns it off; 0.8 averages about 5 steps."},
    "final_kl_target": {"low": 0, "fix": "0 turns it off."},
}


def _reference_move_problems(cfg: TrainConfig) -> list[str]:
    """reference_move's combinations: it needs the budget's pull-backs, a reference of its own and
    a cumulative budget that holds before the first move (where it reads like kl_bound); so does
    kl_adaptive_lr's rate need the budget's scale."""
    p = []
    if cfg.kl_adaptive_lr and cfg.kl_controller != "budget":
        p.append(f"kl_adaptive_lr: the rate follows the budget's kept scale and needs kl_controller='budget', got "
                 f"{cfg.kl_controller!r}; set kl_controller=budget or kl_adaptive_lr=false")
    if cfg.reference_move == "off":
        return p
    what = f"reference_move={cfg.reference_move!r}"
    if cfg.kl_controller != "budget":
        p.append(f"reference_move: {what} is triggered by the budget's pull-backs and needs kl_controller='budget', "
                 f"got {cfg.kl_controller!r}; set kl_controller=budget or reference_move=off")
    if cfg.reference_move == "ema" and (cfg.lora_rank or cfg.adapter):
        p.append(f"reference_move: {what} would mix the LoRA factors separately, which does not mix the adapted "
                 "weights (B A is bilinear in them); use reference_move=reset with LoRA, or lora_rank=0 for 'ema'")
    if cfg.nproc > 1:
        p.append(f"reference_move: {what} keeps the original model unsharded in one process; set nproc=1")
    if cfg.reference_update != "fixed":
        p.append(f"reference_move: {what} and reference_update={cfg.reference_update!r} would both move the reference; "
                 "set reference_update=fixed or reference_move=off")
    if cfg.kl_bound and cfg.reference_move_budget < cfg.kl_bound:
        p.append(f"reference_move_budget: {cfg.reference_move_budget:g} is under kl_bound={cfg.kl_bound:g}, so it would "
                 "bind before the first move, where the original model is the reference; raise it to at least kl_bound")
    return p


def _loop_problems(cfg: TrainConfig) -> list[str]:
    """The loop knobs' checks beyond their sign and choice (``validate`` runs them with the others)."""
    p = []
    batch = cfg.prompts_per_step * cfg.group_size
    if not 1 <= cfg.updates_per_rollout <= max(batch, 1):
        p.append(f"updates_per_rollout: expected 1..{batch} (prompts_per_step * group_size sequences to cut "
                 f"into mini-batches), got {cfg.updates_per_rollout}")
    if cfg.warmup_steps > cfg.steps:
        p.append(f"warmup_steps: {cfg.warmup_steps} is more than steps ({cfg.steps}), so the learning rate "
                 "would never reach learning_rate; lower warmup_steps")
    top = (1 + cfg.kl_band) * cfg.kl_target
    if cfg.kl_controller == "budget" and cfg.kl_bound and top > cfg.kl_bound:
        p.append(f"kl_bound: the budget may keep weights up to (1 + kl_band) x kl_target = {top:g} nats per answer, "
                 f"above kl_bound = {cfg.kl_bound:g}; raise kl_bound to at least {top:g}, or lower kl_target to at most "
                 f"{cfg.kl_bound / (1 + cfg.kl_band):g} (or kl_band)")
    if cfg.trust_region == "dppo_tv":
        fix = "A probability moves by at most 1, so the mask would never act."
        for name in ("trust_region_delta", "trust_region_delta_high"):
            if getattr(cfg, name) >= 1:
                p.append(f"{name}: trust_region='dppo_tv' needs a probability shift in (0, 1), "
                         f"got {getattr(cfg, name)!r}. {fix}")
    if cfg.dual_clip:
        p.extend(problems(real_number, "dual_clip", cfg.dual_clip, low=1, low_open=True, fix="0 turns it off."))
    return p


# Fields that hold several of their choices, comma-separated (the CLI flag may repeat).
LIST_FIELDS = ("report_to",)

# importance_correction's extra name next to the registry's: off.
_NO_CORRECTION: dict[str, None] = {"none": None}
# kl_correction's names for tether.ops.KL_CORRECTIONS' keys ("none": the raw estimator, key None).
KL_LOSS_FORMS: dict[str, str | None] = {"importance": "importance", "none": None}

KL_MODES: dict[str, str] = {
    "loss": "gradient-correct KL term (kl_estimator) in the loss",
    "reward": "k1 per-token penalty in the reward, with reward-to-go",
    "exact": "the exact full-vocabulary KL per answer token as the loss term (needs kl_signal=exact)",
}


def config_choices() -> dict[str, Mapping[str, Any]]:
    """Each choice field and the registry whose names it takes, so a new variant needs no edit here."""
    from tether.control import KL_CONTROLLERS, REFERENCE_MOVES
    from tether.models import REFERENCE_UPDATES
    from tether.objectives import RATIO_LEVELS
    from tether.ops import ADVANTAGE_MODES, AGGREGATION_MODES, IMPORTANCE_WEIGHT_MODES, KL_ESTIMATORS, TRUST_REGIONS
    from tether.integrations.trackers import TRACKERS
    from tether.train.updates import LR_SCHEDULES
    from tether.train.sharding import DEVICES, DTYPES
    from tether.train.data import PROMPT_FORMATS
    from tether.train.updates import KL_SIGNALS

    return {"aggregation": AGGREGATION_MODES, "advantage": ADVANTAGE_MODES, "kl_mode": KL_MODES,
            "kl_estimator": KL_ESTIMATORS, "kl_correction": KL_LOSS_FORMS, "kl_controller": KL_CONTROLLERS, "kl_signal": KL_SIGNALS,
            "kl_control_signal": KL_SIGNALS,
            "reference_update": REFERENCE_UPDATES, "reference_move": REFERENCE_MOVES, "dtype": DTYPES, "device": DEVICES,
            "ratio_level": RATIO_LEVELS, "importance_correction": ChainMap(_NO_CORRECTION, IMPORTANCE_WEIGHT_MODES),
            "trust_region": TRUST_REGIONS, "lr_schedule": LR_SCHEDULES, "report_to": TRACKERS, "prompt_format": PROMPT_FORMATS}


def _unknown_key(key: str, known: Collection[str]) -> str:
    """The problem for an unknown key, with the closest tether key or TRL name as a suggestion."""
    close = difflib.get_close_matches(key, [*known, *TRL_NAMES], n=1, cutoff=0.6)
    if not close:
        return f"unknown key {key!r} (no close match; `tether train --help` lists every key)"
    match = close[0]
    if match in known:
        return f"unknown key {key!r}; did you mean {match!r}?"
    return f"unknown key {key!r}; did you mean {match!r} (TRL's name for {TRL_NAMES[match].target or 'nothing in tether'})?"


def _data_problems(cfg: TrainConfig) -> list[str]:
    from tether.train.data import config_problems

    return config_problems(cfg)


def _finish_problems(cfg: TrainConfig) -> list[str]:
    from tether.train.averaging import config_problems

    return config_problems(cfg)


def _sharding_problems(cfg: TrainConfig) -> list[str]:
    from tether.train.sharding import config_problems

    return config_problems(cfg)


def _task_problem(task: str) -> list[str]:
    from tether.train.tasks import TASKS

    if task in TASKS or (task.endswith(".py") and Path(task).is_file()):
        return []
    return [f"task: expected a registered task {sorted(TASKS)} or an existing .py file, got {task!r}"]


def _convert(raw: Any, kind: type) -> Any:
    if not isinstance(raw, str):
        if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, kind) and not (kind is int and isinstance(raw, bool)):
            return raw
        raise ValueError(raw)
    if kind is bool:
        if raw.lower() in ("1", "true", "yes"):
            return True
        if raw.lower() in ("0", "false", "no"):
            return False
        raise ValueError(raw)
    return kind(raw)
