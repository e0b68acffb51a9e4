"""What an engine returns: :class:`Rollout`, sampled completions with their masks and log-probs."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class Rollout:
    """Sampled completions for N = B*G rows (groups contiguous)."""

    prompt_ids: Tensor  # [N, P] left-padded
    prompt_mask: Tensor  # [N, P]
    completion_ids: Tensor  # [N, C] right-padded
    completion_mask: Tensor  # [N, C] 1 up to and including EOS
    truncated: Tensor  # [N] bool: no EOS within max_new_tokens
    texts: list[str]
    seconds: float
    # [N, C] float32: the sampler's log-prob of each sampled token under the distribution
    # it drew from (temperature, top-k/top-p), 0 at padding; None for greedy decoding.
    logprobs: Tensor | None = None
    # Episodes (lit_grpo.generation.episodes): [N, C] 1 at every real token, the policy's and
    # the tools' (completion_mask is then the policy's tokens only), and each row's record.
    completion_attention: Tensor | None = None
    episodes: list | None = None

    @property
    def lengths(self) -> Tensor:
        return self.completion_mask.sum(-1)  # [N]
