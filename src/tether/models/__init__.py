"""Hugging Face causal-LM wrapper, chat tokenisation, reference copies, reward models, embedded model."""
