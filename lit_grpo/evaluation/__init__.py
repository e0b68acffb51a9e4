"""How well a model answers, and how a run went: the eval command and the curves.

:mod:`~lit_grpo.evaluation.evaluate`: ``lit-grpo eval``, how well a base model or base + adapter
answers held-out prompts; :mod:`~lit_grpo.evaluation.plots`: a run's per-epoch curves (``lit-grpo
plot`` and the PlotCallback); :mod:`~lit_grpo.evaluation.samples`: the rollouts each epoch appends to
``samples.jsonl``.
"""
