"""LLM components on TensorDicts: log-prob retrieval, KL computation and KL reward transforms."""
from tether.llm.batch import chat_batch
