"""Rollouts from a causal LM: TorchRL's step-wise layout, and multi-turn conversations with tools."""

from tether.rollout.calculator import calculator
from tether.rollout.model_rollout import Generation, RolloutFromModel
from tether.rollout.multi_turn import END_REASONS, MultiTurnRollout, episode_metrics
from tether.rollout.prompts import LABEL_IGNORE_INDEX, PromptBatch
from tether.models.special_ids import resolve_eos_ids, resolve_pad_id
from tether.rollout.steps import EpisodeEnds, StepViews, episode_ends, stepwise_views
from tether.rollout.tool_calls import TOOL_CALL_FORMATS, ParsedCall, parse_hermes
from tether.rollout.tools import ERROR_KINDS, TOOLS, Tool, ToolResult, register_tool, resolve_tools, run_tool_call

__all__ = [
    "END_REASONS",
    "ERROR_KINDS",
    "LABEL_IGNORE_INDEX",
    "MultiTurnRollout",
    "ParsedCall",
    "TOOLS",
    "TOOL_CALL_FORMATS",
    "Tool",
    "ToolResult",
    "EpisodeEnds",
    "Generation",
    "PromptBatch",
    "RolloutFromModel",
    "StepViews",
    "calculator",
    "episode_ends",
    "episode_metrics",
    "parse_hermes",
    "register_tool",
    "resolve_tools",
    "run_tool_call",
    "resolve_eos_ids",
    "resolve_pad_id",
    "stepwise_views",
]
