"""LLM components on TensorDicts: log-prob retrieval, KL computation and KL reward transforms."""

from tether.llm.answer_sums import answer_sums
from tether.llm.chat_batch import chat_batch
from tether.llm.kl_computation import KLComputation
from tether.llm.kl_reward import KLRewardTransform
from tether.llm.retrieve_kl import RetrieveKL
from tether.llm.retrieve_log_prob import RetrieveLogProb

__all__ = ["KLComputation", "KLRewardTransform", "RetrieveKL", "RetrieveLogProb", "answer_sums", "chat_batch"]
