"""lit_grpo: GRPO for PyTorch Lightning.

The objective math lives in :mod:`lit_grpo.objectives` (pure torch); rewards
in :mod:`lit_grpo.rewards`; the Lightning pieces import lazily so that
``import lit_grpo.objectives`` never pulls Lightning or transformers.
"""

__version__ = "0.1.0"
