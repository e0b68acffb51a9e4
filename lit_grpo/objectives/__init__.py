"""The GRPO objective as pure functions on tensors (imports only torch).

Pipeline, one rollout batch of B prompts x G completions (N = B*G rows):

* :func:`group_advantages` -- rewards ``[N]`` -> one advantage per completion,
  normalised within its group (docs/design.md, "The objective", 1);
  :func:`decoupled_group_advantages` -- several rewards ``[N, K]``, each
  normalised in its group before they are summed (GDPO). The other advantage
  estimators (``rloo``, ``reinforce_pp``, ``gae``) and how a config picks one
  are in :mod:`lit_grpo.objectives.estimators`.
* :func:`token_logprobs` -- logits ``[N, T, V]`` + sampled tokens ``[N, T]`` ->
  ``[N, T]`` log-probabilities, chunked so no fp32 ``[N, T, V]`` log-softmax is
  ever held (section 2). :func:`token_entropy` is its logging companion.
  :func:`head_logprobs` goes one step further: hidden states + output head ->
  log-probs (and entropy), the logits never held at all.
* :func:`grpo_loss` -- the policy surrogate (clipped; CISPO's capped
  REINFORCE; SAPO's soft gate) + k3 KL (+ an entropy bonus, or training on the
  highest-entropy tokens only), aggregated by ``loss_type`` (sections 3-6);
  returns a :class:`LossOutput` with ``.loss`` and ``.metrics``.
  Its advantages are ``[N]`` (one per completion) or ``[N, T]`` (one per
  token, e.g. REINFORCE++'s).

* :func:`ppo_loss` -- the token-level clipped PPO surrogate on per-token
  (GAE) advantages plus a clipped value loss, same :class:`LossOutput`.

* :func:`dpo_loss` -- preference pairs' summed log-probs (policy and
  reference, see :func:`sequence_logps`) -> the sigmoid DPO loss, same
  :class:`LossOutput`.

* :func:`sft_loss` -- demonstration tokens' log-probs -> their mean NLL;
  :func:`bradley_terry_loss` -- a reward model's scores of preference pairs
  -> the pairwise loss (:mod:`lit_grpo.objectives.sft`).

Other objectives belong in their own module here and return the same
:class:`LossOutput`.
"""

from lit_grpo.objectives.advantages import Advantages, decoupled_group_advantages, group_advantages
from lit_grpo.objectives.dpo import dpo_loss, sequence_logps
from lit_grpo.objectives.estimators import (
    TokenAdvantages,
    discounted_returns,
    gae_advantages,
    ppo_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten,
)
from lit_grpo.objectives.grpo import LossOutput, grpo_loss
from lit_grpo.objectives.logprobs import head_logprobs, token_entropy, token_logprobs
from lit_grpo.objectives.ppo import ppo_loss
from lit_grpo.objectives.sft import bradley_terry_loss, sft_loss

__all__ = [
    "Advantages",
    "bradley_terry_loss",
    "decoupled_group_advantages",
    "LossOutput",
    "TokenAdvantages",
    "discounted_returns",
    "dpo_loss",
    "gae_advantages",
    "group_advantages",
    "grpo_loss",
    "head_logprobs",
    "ppo_loss",
    "ppo_token_rewards",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sequence_logps",
    "sft_loss",
    "token_entropy",
    "token_logprobs",
    "whiten",
]
