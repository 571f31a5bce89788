"""Default TensorDict keys of the LLM KL components, defined once."""

from __future__ import annotations

# Log-probs recorded by the sampling policy, aligned with ("tokens", "full").
SAMPLE_LOG_PROBS = ("log_probs", "full")
# Log-probs of the same tokens under the frozen reference.
REFERENCE_LOG_PROBS = ("ref_log_probs", "full")
