"""Recipes: the GRPO training loop, tasks, config and the ``tether`` command line."""
