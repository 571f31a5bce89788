"""Generic (non-LLM) transforms for probabilistic actors built with tensordict.nn."""
