"""KL coefficient controllers (constant, adaptive) that drive any component with a ``kl_coef``."""
