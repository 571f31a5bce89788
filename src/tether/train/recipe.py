"""The GRPO recipe with a KL leash: config -> models -> rollout -> reward -> reference ->
advantage -> loss -> update -> log, once per step, with exact resume.

Each step samples ``group_size`` answers to each of ``prompts_per_step`` problems into a
``StepRecord``, fills its rewards, reference log-probs and advantages, and takes
``updates_per_rollout`` optimizer steps with the loss written here (equal to the library's
``GRPOLoss``, tests/train/test_recipe_loss.py). The leash is a KL loss term or a k1 reward
penalty; a controller sets its beta from the measured KL. Copy this file to change the
algorithm (``tether cp recipe my_recipe.py``, run with ``python my_recipe.py [tether train
flags]``); ``recipe_ray`` and ``recipe_sharded`` run its stages on Ray workers and on
``--nproc`` FSDP ranks, where ``run.ranks`` sums and gathers whole-batch values (identities here).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch
from tqdm import tqdm

from tether.models.records import GRPOLossOutput, GRPOTokenTerms, StepRecord, group_ids
from tether.ops import (aggregate, aggregate_denominator, effective_sample_size, group_advantages, gspo_log_ratio,
                        importance_weights, kl_estimate, kl_loss_term, reward_to_go, row_slices, trust_region_surrogate)
from tether.train import train_command
from tether.train.averaging import finish_step
from tether.train.config import KL_LOSS_FORMS, TrainConfig
from tether.train.metrics import log_completions
from tether.train.rewards import RewardError, Rewards, Samples, keep_informative, with_checkpoints
from tether.train.run import Rollout, Run, build_run, close_run, close_step, open_run
from tether.train.tasks import Problem, tool_metrics, tool_rollout
from tether.train.updates import (Update, behaviour_kl, check_finite_update, has_exact_kl, hold_kl_budget, mark_step_start,
                                  measure_kl, minibatch_bounds, store_old_log_probs)
from tether.train.variants import hold_variants


# ------------------------------------------------------------------------------ stages
def step_problems(run: Run, step: int, *, every_rank: bool = False) -> list[Problem]:
    """This rank's share of the step's problems (all of them in one process or with
    ``every_rank``), each repeated ``group_size`` times: a pure function of (seed, step)."""
    cfg, first = run.cfg, step * run.cfg.prompts_per_step
    share = range(cfg.prompts_per_step) if every_rank else run.ranks.share(cfg.prompts_per_step)
    problems = [run.task.train_problem(cfg.seed, first + i, run.excluded) for i in share]
    return [p for p in problems for _ in range(cfg.group_size)]


@torch.no_grad()
def sample(run: Run, problems: list[Problem], step: int) -> StepRecord:
    """Rollout: one answer per (repeated) problem from the policy, multi-turn for a tool task."""
    groups = group_ids(len(problems), run.cfg.group_size)
    if run.task.tool_use is not None:
        return StepRecord.from_tensordict(tool_rollout(run, problems), group_ids=groups)
    return run.sampler.sample_record([p.prompt(run.cfg.prompt_format) for p in problems], groups)


def add_rewards(run: Run, record: StepRecord, problems: list[Problem], step: int) -> Rewards:
    """Reward: ``record.rewards`` ``[B]``; a failing reward function names its sample."""
    answers = [row[m].tolist() for row, m in zip(record.tokens, record.assistant_mask)]
    try:
        rewards = run.reward(Samples(problems, record.responses, answers), where=f"step {step + 1}")
    except RewardError as exc:
        raise with_checkpoints(exc, run.dir) from exc
    record.rewards = rewards.total
    return rewards


@torch.no_grad()
def add_reference(run: Run, record: StepRecord) -> None:
    """Reference: log-probs at the answer tokens, and its hidden states there when the loss
    pass is to measure the exact KL. A rollout that brought them (Ray) is left as it is."""
    if record.ref_log_probs is not None:
        return
    exact = run.cfg.kl_signal == "exact" and has_exact_kl(run.models.policy)
    ref = run.ref_scorer.score(record.tokens, record.attention_mask, where=record.assistant_mask, keep_hidden=exact)
    record.ref_log_probs, record.ref_hidden = ref.log_probs.to(record.tokens.device), ref.hidden


def add_advantages(run: Run, record: StepRecord) -> None:
    """Advantage: group-normalised outcome advantages, plus the reward-to-go of the k1 penalty
    per token when the leash is in the reward."""
    mask = record.assistant_mask  # rewards and groups stay on the host: moved to the mask's device
    advantage = group_advantages(record.rewards, record.group_ids, mode=run.cfg.advantage)[:, None].to(mask.device)
    if run.cfg.kl_mode == "reward":
        penalty = -run.leash.kl_coef * record.token_log_ratio()
        advantage = advantage + reward_to_go(penalty, mask)
    record.advantages = advantage.expand_as(mask) * mask


# ------------------------------------------------------------------------------ the loss
def token_terms(run: Run, rows: StepRecord) -> GRPOTokenTerms:
    """Loss, per answer token ``[B, T]`` (0 elsewhere): the policy ratio's surrogate in its trust region,
    the entropy, the leash's KL term, and the detached diagnostics (``GRPOLoss``'s terms)."""
    cfg, mask = run.cfg, rows.assistant_mask & rows.attention_mask
    exact = cfg.kl_mode == "exact"  # the exact KL is then the leash's loss term, in the graph
    if exact and rows.ref_hidden is None:
        raise ValueError("kl_mode='exact' needs the reference's hidden states (kl_signal='exact' and a linear "
                         "output head; Ray rollouts bring log-probs only): use kl_mode='loss' there.")
    scored = run.actor.score(rows.tokens, rows.attention_mask, with_entropy=True, where=mask, kl_to=rows.ref_hidden,
                             kl_grad=exact)
    mask = mask.to(scored.log_probs.device)

    def on_answers(values: torch.Tensor) -> torch.Tensor:  # padding may hold NaN: replaced, never multiplied
        return torch.where(mask, values.to(scored.log_probs), 0.0)

    logp, sampled = on_answers(scored.log_probs), on_answers(rows.sample_log_probs)
    # The ratio's denominator: the sampler's log-probs, or under TIS/MIS the trainer's own under the
    # sampling weights (stored when several updates reuse the rollout; else the current ones).
    old = sampled if cfg.importance_correction == "none" else on_answers(
        rows.old_log_probs if rows.old_log_probs is not None else logp.detach())
    log_ratio = gspo_log_ratio(logp, old, mask) if cfg.ratio_level == "sequence" else torch.where(mask, logp - old, 0.0)
    clip = (cfg.clip_epsilon, cfg.clip_epsilon_high) if cfg.clip_epsilon_high else cfg.clip_epsilon
    delta = (cfg.trust_region_delta, cfg.trust_region_delta_high or cfg.trust_region_delta)
    surrogate = trust_region_surrogate(log_ratio, on_answers(rows.advantages), logp, sampled, kind=cfg.trust_region,
                                       clip_epsilon=clip, delta=delta, dual_clip=cfg.dual_clip or None)
    policy = surrogate.loss
    if cfg.importance_correction != "none":
        policy = policy * importance_weights(old, sampled, mask, mode=cfg.importance_correction, cap=cfg.importance_cap)
    entropy = on_answers(scored.entropy)
    terms = GRPOTokenTerms(mask=mask, policy=policy, clipped=surrogate.clipped.to(logp.dtype),
                           ratio_gap=torch.where(mask, old - logp.detach(), 0.0),
                           log_weights=torch.where(mask, logp.detach() - sampled, 0.0),
                           # at coefficient 0 the entropy is a diagnostic: backward skips its vocabulary-wide gradient
                           entropy=entropy if cfg.entropy_coeff else entropy.detach())
    if cfg.kl_mode == "loss":  # importance-weighted by default: the gradient of KL(pi || pi_ref) in expectation
        ref = on_answers(rows.ref_log_probs)
        form = KL_LOSS_FORMS[cfg.kl_correction]
        terms.kl_to_ref_term = on_answers(kl_loss_term(logp, ref, estimator=cfg.kl_estimator, correction=form,
                                                       old_logp=sampled if form else None))
        terms.kl_to_ref = on_answers(kl_estimate(logp.detach(), ref, cfg.kl_estimator))
    if scored.exact_kl is not None:
        terms.kl_to_ref_exact = on_answers(scored.exact_kl.detach())
    if exact:
        terms.kl_to_ref_term, terms.kl_to_ref = on_answers(scored.exact_kl), terms.kl_to_ref_exact
    return terms


def reduce(run: Run, terms: GRPOTokenTerms, denominator: torch.Tensor | None = None) -> GRPOLossOutput:
    """The loss of ``terms`` through the one reduction, ``aggregate`` (``denominator`` replaces its
    outer count, so micro-batches add up to their batch), and the diagnostics as token means."""
    cfg, mask = run.cfg, terms.mask
    normalizer = cfg.max_new_tokens if cfg.aggregation == "seq-mean-token-sum-norm" else None
    total = partial(aggregate, mask=mask, mode=cfg.aggregation, normalizer=normalizer, denominator=denominator)
    mean = partial(aggregate, mask=mask, mode="token-mean")
    leash = {} if terms.kl_to_ref_term is None else {
        "loss_kl_to_ref": run.leash.kl_coef * total(terms.kl_to_ref_term), "kl_to_ref": mean(terms.kl_to_ref)}
    return GRPOLossOutput(
        loss_objective=total(terms.policy), loss_entropy=-cfg.entropy_coeff * total(terms.entropy), **leash,
        clip_fraction=mean(terms.clipped), kl_approx=mean(terms.ratio_gap), entropy=mean(terms.entropy.detach()),
        ESS=effective_sample_size(terms.log_weights, mask) / mask.sum().clamp_min(1).to(terms.log_weights.dtype),
        kl_to_ref_exact=None if terms.kl_to_ref_exact is None else mean(terms.kl_to_ref_exact), batch_size=[])


# ------------------------------------------------------------------------------ the update
def optimize(run: Run, record: StepRecord, step: int) -> Update:
    """``updates_per_rollout`` optimizer steps, one a mini-batch; a non-finite loss or gradient norm
    raises before the weights move. All updates' terms reduced together give the step's
    diagnostics (ESS is no token mean: it cannot be averaged)."""
    cfg, kept, norms = run.cfg, [], []
    if cfg.updates_per_rollout > 1 and cfg.importance_correction != "none":
        record.old_log_probs = store_old_log_probs(run.actor, record, cfg.micro_batch_size)
    params = [p for p in run.models.policy.parameters() if p.requires_grad]
    for begin, end in minibatch_bounds(len(record), cfg.updates_per_rollout):
        kept.append(accumulate_gradients(run, record.rows(begin, end)))
        loss = float(reduce(run, kept[-1]).total_loss())
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or float("inf"))))
        check_finite_update(loss, norms[-1], step, run.dir)
        run.optimizer.step()
    # Spent: held on, the gradients would sit beside the budget's copies through the readings and
    # the next step's sampling (one more copy of the trainable weights; docs/performance.md).
    run.optimizer.zero_grad(set_to_none=True)
    terms = run.ranks.all_rows(GRPOTokenTerms.cat(kept))  # every rank's rows
    return Update(reduce(run, terms), sum(norms) / len(norms), terms)


def accumulate_gradients(run: Run, record: StepRecord) -> GRPOTokenTerms:
    """``record``'s gradient, micro-batch by micro-batch against its whole denominator; its detached terms."""
    denominator = run.ranks.total(aggregate_denominator(record.assistant_mask, run.cfg.aggregation))
    run.optimizer.zero_grad(set_to_none=True)
    kept = []
    for begin, end in row_slices(len(record), run.cfg.micro_batch_size):
        terms = token_terms(run, record.rows(begin, end))
        reduce(run, terms, denominator).total_loss().backward()
        kept.append(terms.detach())
    return GRPOTokenTerms.cat(kept)


def train_step(run: Run, step: int, rollout: Rollout = sample) -> dict[str, Any]:
    """One step, every stage in order; returns its line of metrics."""
    cfg, ranks, start = run.cfg, run.ranks, time.perf_counter()

    def draw(problems: list[Problem]) -> tuple[StepRecord, Rewards]:  # rollout, then reward
        record = rollout(run, problems, step)
        return record, add_rewards(run, record, problems, step)

    problems, record, rewards, drawn = keep_informative(run, step, draw, step_problems(run, step))
    add_reference(run, record)
    sampled_kl = ranks.rows(record.sequence_log_ratio())  # every rank's answers
    if cfg.kl_control_signal == "sampled" and cfg.kl_controller != "budget":  # beta for this update, from this batch's KL
        run.controller.update(sampled_kl)
    add_advantages(run, record)
    kl_coef, lr = float(run.leash.kl_coef), run.optimizer.param_groups[0]["lr"]
    mark_step_start(run)  # kl_controller=budget: what a rejected update returns to
    update = optimize(run, record, step)
    move = hold_kl_budget(run, record)  # the budget's move or rejection, and the ceiling kl_bound, on the kept weights
    run.scheduler.step()
    leash = {**({} if move is None else move.metrics()), **hold_variants(run, record, move)}  # docs/leash.md
    leash.update(finish_step(run, record, step))  # weight_average, and after the last step the finishes
    kl = measure_kl(sampled_kl, update.terms.kl_to_ref_exact, update.terms.mask)
    if cfg.kl_control_signal == "exact" and cfg.kl_controller != "budget":  # known only now: beta for the next update
        run.controller.update(kl.signal)
    if run.ref_updater is not None:
        run.ref_updater.step(step + 1)
    if ranks.writer:  # this rank's rows
        log_completions(run, step + 1, [p.chat[-1]["content"] for p in problems], record.responses, record.rewards,
                        rewards.correct)
    rewards, out, elapsed = ranks.all_rows(rewards), update.output, time.perf_counter() - start
    return {
        "step": step + 1, "reward_mean": float(rewards.total.mean()), "reward_std": float(rewards.total.std()),
        **({} if rewards.correct is None else {"accuracy": float(rewards.correct.mean())}),
        **{f"reward/{name}": float(v.nanmean()) for name, v in rewards.per_function.items()},
        **kl.metrics(cfg.kl_bound, kept=leash.get("kl_kept_per_seq")), "kl_coef": kl_coef, **leash, **drawn,
        "kl_behaviour_per_token": behaviour_kl(update.terms),
        "clip_fraction": float(out.clip_fraction), "ess": float(out.ESS), "entropy": float(out.entropy),
        "response_length": float(update.terms.mask.sum(-1).float().mean()), "grad_norm": update.grad_norm, "lr": lr,
        "loss": float(out.total_loss()), "step_time": elapsed,
        "tokens_per_s": float(ranks.total(record.attention_mask.sum())) / elapsed,
        **tool_metrics(record.episode),
    }


# ------------------------------------------------------------------------------ main loop
def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True, rollout: Rollout = sample,
          run: Run | None = None) -> dict[str, Any]:
    """Run (or resume) training; returns the summary (``summary.json``). Another topology passes its
    ``rollout`` and ``run`` to reuse the loop."""
    run = build_run(cfg, fresh=not resume) if run is None else run
    try:
        opened = open_run(run, resume=resume, progress=progress)
        bar = tqdm(range(opened.start, cfg.steps), initial=opened.start, total=cfg.steps, desc="tether train",
                   disable=not (progress and run.ranks.writer), dynamic_ncols=True)
        for step in bar:
            line = train_step(run, step, rollout)
            close_step(run, opened, line)
            accuracy = {"acc": f"{line['accuracy']:.2f}"} if "accuracy" in line else {}  # none in dataset runs
            bar.set_postfix(reward=f"{line['reward_mean']:.3f}", **accuracy, kl=f"{line['kl_per_seq']:.3f}",
                            beta=f"{line['kl_coef']:.3g}")
        return close_run(run, opened)
    finally:
        run.tracker.close()


def main(argv: list[str] | None = None) -> int:
    """``python recipe.py [tether train flags]``: a copied recipe runs like ``tether train``."""
    return train_command.main(argv, train_fn=train)


if __name__ == "__main__":
    raise SystemExit(main())
