"""Pure, typed tensor math: log-probs, KL estimators, reductions, advantages, policy losses."""
