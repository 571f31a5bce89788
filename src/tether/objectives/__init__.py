"""Losses and advantage estimators: GRPOLoss and MCAdvantage."""

from tether.objectives.grpo import RATIO_LEVELS, GRPOLoss
from tether.objectives.grpo_inputs import GRPOBatch, GRPOKeys, read_grpo_batch
from tether.models.records import LOSS_FIELDS, GRPOLossOutput, GRPOTokenTerms
from tether.objectives.group_advantage import mc_group_advantages
from tether.objectives.mc_advantage import MCAdvantage, prompt_group_key

__all__ = [
    "GRPOLoss",
    "GRPOLossOutput",
    "GRPOTokenTerms",
    "GRPOKeys",
    "GRPOBatch",
    "LOSS_FIELDS",
    "RATIO_LEVELS",
    "MCAdvantage",
    "mc_group_advantages",
    "prompt_group_key",
    "read_grpo_batch",
]
