"""Pure, typed tensor math: log-probs, KL estimators, reductions, advantages, policy losses."""
from tether.ops.logprobs import (
    TokenStats,
    token_entropy,
    token_entropy_from_hidden,
    token_logprobs,
    token_logprobs_from_hidden,
    token_stats_from_hidden,
)
from tether.ops.exact_kl import exact_kl, exact_kl_from_hidden
from tether.ops.kl import KL_CORRECTIONS, KL_ESTIMATORS, kl_abs, kl_estimate, kl_k1, kl_k2, kl_k3, kl_loss_term
from tether.ops.aggregate import AGGREGATION_MODES, aggregate, aggregate_denominator
from tether.ops.masks import even_slices, row_slices
from tether.ops.advantages import ADVANTAGE_MODES, STD_MODES, group_advantages, reward_to_go
from tether.ops.policy_loss import (
    IMPORTANCE_WEIGHT_MODES,
    PolicyLoss,
    clipped_surrogate,
    effective_sample_size,
    gspo_log_ratio,
    importance_weights,
)
from tether.ops.trust_region import TRUST_REGIONS, bernoulli_kl, trust_region_surrogate, tv_shift
from tether.ops.masks import (
    PADDING_SIDES,
    Padded,
    mask_from_lengths,
    nested_to_padded,
    padded_to_nested,
    ragged_dim_of,
    response_mask,
    truncate_at_first_eos,
)

__all__ = [
    "ADVANTAGE_MODES",
    "AGGREGATION_MODES",
    "IMPORTANCE_WEIGHT_MODES",
    "KL_CORRECTIONS",
    "KL_ESTIMATORS",
    "PADDING_SIDES",
    "Padded",
    "PolicyLoss",
    "STD_MODES",
    "TRUST_REGIONS",
    "TokenStats",
    "aggregate",
    "aggregate_denominator",
    "bernoulli_kl",
    "clipped_surrogate",
    "even_slices",
    "effective_sample_size",
    "exact_kl",
    "exact_kl_from_hidden",
    "group_advantages",
    "gspo_log_ratio",
    "importance_weights",
    "kl_abs",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_loss_term",
    "mask_from_lengths",
    "nested_to_padded",
    "padded_to_nested",
    "ragged_dim_of",
    "response_mask",
    "reward_to_go",
    "token_entropy",
    "token_entropy_from_hidden",
    "token_logprobs",
    "token_logprobs_from_hidden",
    "token_stats_from_hidden",
    "truncate_at_first_eos",
    "trust_region_surrogate",
    "tv_shift",
    "row_slices",
]
