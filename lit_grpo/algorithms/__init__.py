"""The LightningModules, one per training algorithm.

:mod:`~lit_grpo.algorithms.base` holds :class:`PolicyModule`, what they share
about the policy (loading, the reference, the optimizer, checkpoints);
:mod:`~lit_grpo.algorithms.grpo`, :mod:`~lit_grpo.algorithms.ppo` and
:mod:`~lit_grpo.algorithms.dpo` add each algorithm's training step. Their
losses are pure functions in :mod:`lit_grpo.objectives`; their batches come
from :mod:`lit_grpo.data`.
"""
