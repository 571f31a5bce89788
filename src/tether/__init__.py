"""tether: reinforcement-learning post-training of language models on a KL leash.

Layers, bottom to top (a layer may import only those below it):
``tether.ops`` (pure math) -> ``tether.models`` (HF wrappers) -> components
(``tether.llm``, ``tether.transforms``, ``tether.objectives``, ``tether.control``,
``tether.rollout``) -> ``tether.ray`` (distributed) -> ``tether.train`` (recipes, CLI).
"""

__version__ = "0.1.0"

import warnings as _warnings

from tether._compat import version_problems as _version_problems

for _problem in _version_problems():
    _warnings.warn(_problem, RuntimeWarning, stacklevel=2)
