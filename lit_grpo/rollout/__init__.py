"""Rollouts as a producer: prompts in, a scored and versioned rollout out.

:class:`~lit_grpo.rollout.producer.RolloutProducer` owns sampling, scoring and
the advantage estimator (:mod:`~lit_grpo.rollout.estimators`); what it needs
of the policy is :class:`~lit_grpo.rollout.policy.RolloutPolicy`. The
on-policy DataModule hands it prompts and serves its
:class:`~lit_grpo.rollout.producer.ScoredRollout` as micro-batches.
"""
