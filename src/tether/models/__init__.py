"""Hugging Face causal-LM wrapper, chat tokenisation, reference copies, reward models, embedded model."""

from tether.models.chat import ChatTokens, has_generation_block, tokenize_chats
from tether.models.default_model import DefaultModelInfo, load_default_model, locate_gguf, model_info
from tether.models.reference import (
    REFERENCE_UPDATES,
    AdapterDisabledReference,
    ReferenceUpdater,
    adapter_disabled,
    frozen_copy,
)
from tether.models.reward_model import RewardOutput, SequenceRewardModel
from tether.models.records import Scorer
from tether.models.wrapper import INPUT_MODES, TransformersWrapper

__all__ = [
    "AdapterDisabledReference",
    "ChatTokens",
    "DefaultModelInfo",
    "INPUT_MODES",
    "REFERENCE_UPDATES",
    "ReferenceUpdater",
    "RewardOutput",
    "Scorer",
    "SequenceRewardModel",
    "TransformersWrapper",
    "adapter_disabled",
    "frozen_copy",
    "has_generation_block",
    "load_default_model",
    "locate_gguf",
    "model_info",
    "tokenize_chats",
]
