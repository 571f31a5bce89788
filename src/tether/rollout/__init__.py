"""Rollouts from a causal LM in the step-wise TensorDict layout of the seeds."""

from tether.rollout.model_rollout import Generation, RolloutFromModel
from tether.rollout.prompts import LABEL_IGNORE_INDEX, PromptBatch
from tether.models.special_ids import resolve_eos_ids, resolve_pad_id
from tether.rollout.steps import EpisodeEnds, StepViews, episode_ends, stepwise_views

__all__ = [
    "LABEL_IGNORE_INDEX",
    "EpisodeEnds",
    "Generation",
    "PromptBatch",
    "RolloutFromModel",
    "StepViews",
    "episode_ends",
    "resolve_eos_ids",
    "resolve_pad_id",
    "stepwise_views",
]
