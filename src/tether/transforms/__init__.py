"""Generic (non-LLM) transforms for probabilistic actors built with tensordict.nn."""

from tether.transforms.kl_reward import KLRewardTransform

__all__ = ["KLRewardTransform"]
