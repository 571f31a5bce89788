"""Rollouts from a causal LM in the step-wise TensorDict layout of the seeds."""
