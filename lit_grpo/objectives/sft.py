"""Supervised fine-tuning and reward-model losses on tensors.

* :func:`sft_loss`: the negative log-likelihood of the demonstration tokens,
  averaged over the tokens the loss mask keeps (the completion / assistant
  tokens; the prompt's are context only), as TRL's ``SFTTrainer`` does with
  ``completion_only_loss``.
* :func:`bradley_terry_loss`: the reward model's pairwise loss
  ``-log sigmoid(r(chosen) - r(rejected))`` (Bradley and Terry, 1952; the
  InstructGPT reward model), with the pairwise accuracy and the margin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_grpo.objectives.grpo import LossOutput, at_least_fp32


def sft_loss(logprobs: Tensor, loss_mask: Tensor) -> LossOutput:
    """Mean negative log-likelihood over the trained tokens of a batch.

    Args:
        logprobs: ``[N, T]`` log-prob of each token given the ones before it
            (padding may hold anything finite).
        loss_mask: ``[N, T]`` 1 where the token is trained on, 0 elsewhere
            (prompt, padding, other speakers' turns).

    Returns:
        :class:`LossOutput`: ``loss`` (the token mean over the batch, so every
        trained token weighs the same) and no further ``metrics``.

    Raises:
        ValueError: Shapes differ, or no token is trained on.
    """
    if logprobs.shape != loss_mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and loss_mask {tuple(loss_mask.shape)} differ in shape")
    keep = loss_mask.bool()  # [N, T]
    tokens = keep.sum()
    if tokens == 0:
        raise ValueError("sft_loss: the loss mask keeps no token (every completion is empty)")
    (logprobs,) = at_least_fp32(logprobs)
    nll = -torch.where(keep, logprobs, 0.0).sum() / tokens
    return LossOutput(loss=nll, metrics={})


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor) -> LossOutput:
    """``-log sigmoid(chosen - rejected)``, averaged over the B pairs.

    Args:
        chosen_rewards: ``[B]`` scalar rewards of the preferred replies (with grad).
        rejected_rewards: ``[B]`` rewards of the dispreferred replies.

    Returns:
        :class:`LossOutput`: ``loss``; ``metrics`` ``accuracy`` (fraction of
        pairs whose chosen reward is strictly higher), ``margin`` (mean of
        chosen - rejected), ``chosen`` and ``rejected`` (mean rewards).

    Raises:
        ValueError: The inputs are not the same ``[B]`` shape.
    """
    if chosen_rewards.shape != rejected_rewards.shape or chosen_rewards.dim() != 1:
        raise ValueError(
            f"chosen_rewards {tuple(chosen_rewards.shape)} and rejected_rewards "
            f"{tuple(rejected_rewards.shape)} must be the same [B] shape"
        )
    chosen_rewards, rejected_rewards = at_least_fp32(chosen_rewards, rejected_rewards)
    margin = chosen_rewards - rejected_rewards  # [B]
    metrics = {
        "accuracy": (margin > 0).to(margin.dtype).mean(),
        "margin": margin.mean(),
        "chosen": chosen_rewards.mean(),
        "rejected": rejected_rewards.mean(),
    }
    # logsigmoid, not log(sigmoid()): finite for large negative margins.
    return LossOutput(loss=-F.logsigmoid(margin).mean(), metrics={k: v.detach() for k, v in metrics.items()})
