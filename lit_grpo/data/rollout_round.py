"""One rollout round: prompts -> completions -> rewards -> advantages -> buffer rows.

Kept apart from the DataModule so the sequence reads top to bottom. With
dynamic sampling (DAPO) groups whose rewards are all equal carry no signal;
they are replaced by groups of fresh prompts for up to
``max_sampling_rounds`` rounds, and if signal is still short the buffer is
topped up with collapsed groups so every rank trains on the same number of
rows (a DDP requirement).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from lit_grpo.data.episodes import ENVIRONMENT_REWARD, environment_rewards
from lit_grpo.generation.episodes import episode_stats
from lit_grpo.generation.rollout import Rollout
from lit_grpo.objectives import (gae_advantages, group_advantages, ppo_token_rewards, reinforce_pp_advantages,
                                 rloo_advantages, whiten)


# Rollout statistics whose value over all ranks is their maximum (the rest are means).
MAX_STATS = ("completion/length_max",)


@dataclass
class RolloutResult:
    rows: dict[str, Tensor]
    stats: dict[str, float]
    samples: list[tuple]  # (prompt, completion, reward[, an episode's messages]) for logging


@dataclass
class _Group:
    prompt_ids: Tensor  # [G, P]
    prompt_mask: Tensor  # [G, P]
    completion_ids: Tensor  # [G, C]
    completion_mask: Tensor  # [G, C]
    truncated: Tensor  # [G]
    sampler_logprobs: Tensor  # [G, C]
    rewards: Tensor  # [G]
    per_function: dict[str, Tensor]  # name -> [G]
    prompt: str
    texts: list[str]
    completion_attention: Tensor | None = None  # [G, C] episodes: every real token
    episodes: list | None = None  # episodes: each completion's EpisodeRecord


def collect_rollout(datamodule, module, rank: int) -> RolloutResult:
    """Run one epoch's rollout for this rank (see the module docstring)."""
    hp, sampling = datamodule.hparams, datamodule.sampling
    G, local = sampling.group_size, datamodule.prompts_per_rank
    timings = {"generate": 0.0, "reward": 0.0}
    kept: list[_Group] = []
    spare: list[_Group] = []
    generated_tokens = 0
    rounds = hp.max_sampling_rounds if hp.dynamic_sampling else 1
    for round_index in range(rounds):
        prompts = datamodule.next_prompts(hp.prompts_per_epoch)[rank * local : (rank + 1) * local]
        groups, tokens = _sample_groups(datamodule, module, prompts, timings, round_index)
        generated_tokens += tokens
        for group in groups:
            collapsed = hp.dynamic_sampling and bool(group_advantages(group.rewards, G).collapsed[0])
            (spare if hp.dynamic_sampling and collapsed else kept).append(group)
        missing = torch.tensor(float(max(local - len(kept), 0)))
        if datamodule.trainer.strategy.reduce(missing, reduce_op="sum") == 0:
            break
    groups = (kept + spare)[:local]
    _warn_if_all_empty(groups, datamodule.trainer.current_epoch)
    rows, stats = _assemble(groups, module, datamodule, timings)
    stats.update(_rollout_stats(groups, rows, G))
    stats["rollout/tokens_per_s"] = generated_tokens / max(timings["generate"], 1e-9)
    stats["rollout/generated_tokens"] = float(generated_tokens)  # dynamic sampling's dropped groups included
    stats["rollout/rounds"] = float(round_index + 1)
    stats.update({f"time/{name}": seconds for name, seconds in timings.items()})
    samples = [(g.prompt, datamodule.full_completions(g.texts[:1])[0], float(g.rewards[0]))
               + ((g.episodes[0].messages,) if g.episodes else ()) for g in groups[:2]]
    if groups[0].episodes is not None:
        stats.update(episode_stats([record for g in groups for record in g.episodes]))
    return RolloutResult(rows, stats, samples)


def _warn_if_all_empty(groups: list[_Group], epoch: int) -> None:
    # Not an error: a policy can pass through this and recover. But when it happens
    # from the first epoch on, the chat template or the EOS tokens are usually wrong.
    if any(text.strip() for group in groups for text in group.texts):
        return
    warnings.warn(
        f"epoch {epoch}: all {sum(len(g.texts) for g in groups)} completions are empty (the policy "
        "ended every answer at once), so the rewards cannot tell them apart and only the KL term "
        "trains. Expected some text; check policy.name_or_path's chat template and EOS tokens, "
        "data.prompt_template and sampling.temperature.",
        RuntimeWarning,
        stacklevel=2,
    )


def _sample_groups(datamodule, module, prompts: list[dict], timings: dict, round_index: int):
    sampling, G = datamodule.sampling, datamodule.sampling.group_size
    spec = environments = None
    if datamodule.episodes is not None:
        prompt_ids, prompt_mask, spec, environments = datamodule.episodes.start(datamodule, prompts, G)
    else:
        prompt_ids, prompt_mask = datamodule.encode(prompts)
    steps = sampling.max_new_tokens if spec is None else spec.max_episode_tokens
    rollout: Rollout = module.engine.generate(
        prompt_ids, prompt_mask, sampling, episodes=spec,
        progress=module.show_progress(f"rollout {round_index + 1}", steps))
    timings["generate"] += rollout.seconds
    start = time.perf_counter()
    rows = [row for row in prompts for _ in range(G)]
    columns = {key: [row.get(key) for row in rows] for key in rows[0] if key != "prompt"}
    columns["completion_length"] = rollout.lengths.tolist()
    if spec is None:
        completions = datamodule.full_completions(rollout.texts)
    else:  # TRL's conversational completions; text rewards read the final answers
        completions = [record.messages for record in rollout.episodes]
        columns[ENVIRONMENT_REWARD] = environment_rewards(environments)
    scores = datamodule.rewards.score([r["prompt"] for r in rows], completions, columns)
    timings["reward"] += time.perf_counter() - start
    groups = []
    for i, prompt in enumerate(prompts):
        s = slice(i * G, (i + 1) * G)
        groups.append(_Group(
            rollout.prompt_ids[s], rollout.prompt_mask[s], rollout.completion_ids[s],
            rollout.completion_mask[s], rollout.truncated[s], rollout.logprobs[s], scores.total[s],
            {name: values[s] for name, values in scores.per_function.items()},
            prompt["prompt"], rollout.texts[s],
            None if spec is None else rollout.completion_attention[s], None if spec is None else rollout.episodes[s],
        ))
    return groups, int(rollout.lengths.sum())


def _assemble(groups: list[_Group], module, datamodule, timings: dict):
    hp, sampling = datamodule.hparams, datamodule.sampling
    pad = module.tokenizer.pad_token_id
    rows = {
        # prompts stay left-padded: flip, right-pad, flip back
        "prompt_ids": _left_pad([g.prompt_ids for g in groups], pad),  # [N, P]
        "prompt_mask": _left_pad([g.prompt_mask for g in groups], 0),  # [N, P]
        "completion_ids": _right_pad([g.completion_ids for g in groups], pad),  # [N, C]
        "completion_mask": _right_pad([g.completion_mask for g in groups], 0),  # [N, C]
        "sampler_logprobs": _right_pad([g.sampler_logprobs for g in groups], 0.0),  # [N, C]
    }
    if groups[0].completion_attention is not None:  # episodes: tool tokens are attended to, not trained on
        rows["completion_attention"] = _right_pad([g.completion_attention for g in groups], 0)  # [N, C]
    truncated = torch.cat([g.truncated for g in groups])  # [N]
    length_stats = {"rollout/truncated_fraction": truncated.float().mean().item()}
    if sampling.mask_truncated:
        sampled = rows["completion_mask"]  # [N, C]
        rows["completion_mask"] = sampled * (~truncated).unsqueeze(-1)
        # what DAPO's overlong filtering costs: truncated rows are the long ones, so their
        # share of the tokens is larger than their share of the rows
        length_stats["rollout/masked_token_fraction"] = 1 - (rows["completion_mask"].sum()
                                                             / sampled.sum().clamp(min=1)).item()
    rewards = torch.cat([g.rewards for g in groups])  # [N]
    start = time.perf_counter()
    if module.needs_reference:
        rows["ref_logprobs"] = module.rollout_logprobs(rows, sampling.temperature, reference=True)
        timings["reference"] = time.perf_counter() - start
    steps_per_rollout = len(rewards) // hp.batch_size // datamodule.trainer.accumulate_grad_batches
    if hp.num_iterations > 1 or steps_per_rollout > 1 or module.needs_old_logprobs:
        # The policy moves between optimizer steps on this rollout, so pi_old must
        # be frozen now; with a single step pi_old = pi_theta and the training
        # step uses its own detached log-probs instead (no extra forward pass).
        start = time.perf_counter()
        rows["old_logprobs"] = module.rollout_logprobs(rows, sampling.temperature, reference=False)
        timings["old_logprobs"] = time.perf_counter() - start
    estimated, stats = ESTIMATORS[datamodule.advantage_estimator].compute(rewards, rows, module, datamodule)
    rows.update(estimated)
    stats.update(length_stats)
    return rows, stats


def _group_relative(rewards: Tensor, rows: dict, module, datamodule):
    result = group_advantages(rewards, datamodule.sampling.group_size, scale=datamodule.hparams.advantage_scale)
    return {"advantages": result.advantages}, {"rollout/collapsed_fraction": result.collapsed.float().mean().item()}


def _leave_one_out(rewards: Tensor, rows: dict, module, datamodule):
    result = rloo_advantages(rewards, datamodule.sampling.group_size)
    return {"advantages": result.advantages}, {"rollout/collapsed_fraction": result.collapsed.float().mean().item()}


def _gae(rewards: Tensor, rows: dict, module, datamodule):
    """Per-token GAE advantages (whitened over the rollout's real tokens) and returns.

    The values come from the module's critic as it was at rollout time; the
    per-token rewards carry the sequence reward on the last token and, with
    ``kl_coef > 0``, minus ``kl_coef`` times the k1 KL to the reference.
    """
    mask = rows["completion_mask"]  # [N, C]
    values = module.rollout_values(rows)  # [N, C]
    hp = module.hparams
    token_rewards = ppo_token_rewards(rewards, mask, rows.get("old_logprobs"), rows.get("ref_logprobs"),
                                      beta=hp.kl_coef)  # [N, C]
    result = gae_advantages(token_rewards, values, mask, gamma=hp.gamma, lam=hp.lam)
    advantages = whiten(result.advantages, mask) if hp.whiten_advantages else result.advantages  # [N, C]
    real = mask.bool()
    stats = {"rollout/value_mean": values[real].mean().item() if real.any() else 0.0,
             "rollout/return_mean": result.returns[real].mean().item() if real.any() else 0.0}
    return {"advantages": advantages, "values": values, "returns": result.returns}, stats


def _reinforce_pp(rewards: Tensor, rows: dict, module, datamodule):
    """REINFORCE++ per-token advantages: returns whitened over the rollout's real tokens.

    The per-token rewards carry the sequence reward on the last token and, with
    the module's ``beta > 0``, minus ``beta`` times the k1 KL of the rollout
    policy to the reference; gamma is 1. The whitening statistics are this
    rank's (no cross-rank reduction), as for ``gae``.
    """
    mask = rows["completion_mask"]  # [N, C]
    beta = module.hparams.beta
    result = reinforce_pp_advantages(rewards, mask, rows.get("old_logprobs"), rows.get("ref_logprobs"), beta=beta)
    real = mask.bool()
    stats = {"rollout/return_mean": result.returns[real].mean().item() if real.any() else 0.0}
    if beta > 0:
        k1 = rows["old_logprobs"] - rows["ref_logprobs"]  # [N, C]
        stats["rollout/kl"] = k1[real].mean().item() if real.any() else 0.0
    return {"advantages": result.advantages}, stats


class Estimator(NamedTuple):
    """An advantage estimator the DataModule can be configured with.

    Attributes:
        compute: ``(rewards [N], rows, module, datamodule) -> (rows to add, stats)``.
        needs_group: Baselines from the other completions of the prompt (G >= 2).
    """

    compute: Callable
    needs_group: bool


# data.advantage_estimator -> how the rollout's advantages are computed.
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(_group_relative, needs_group=True),
    "rloo": Estimator(_leave_one_out, needs_group=True),
    "gae": Estimator(_gae, needs_group=False),
    "reinforce_pp": Estimator(_reinforce_pp, needs_group=False),
}


def _rollout_stats(groups: list[_Group], rows: dict[str, Tensor], G: int) -> dict[str, float]:
    rewards = torch.cat([g.rewards for g in groups])  # [N]
    lengths = torch.cat([g.completion_mask.sum(-1) for g in groups]).float()  # [N]
    stats = {
        "reward/total": rewards.mean().item(),
        "reward/std": rewards.view(-1, G).std(-1, unbiased=False).mean().item(),
        "completion/length_mean": lengths.mean().item(),
        "completion/length_max": lengths.max().item(),
    }
    for name in groups[0].per_function:
        values = torch.cat([g.per_function[name] for g in groups])
        stats[f"reward/{name}"] = values.nanmean().item() if not values.isnan().all() else float("nan")
    return stats


def _right_pad(tensors: list[Tensor], value: int) -> Tensor:
    rows = [row for t in tensors for row in t]
    return pad_sequence(rows, batch_first=True, padding_value=value)


def _left_pad(tensors: list[Tensor], value: int) -> Tensor:
    rows = [row.flip(0) for t in tensors for row in t]
    return pad_sequence(rows, batch_first=True, padding_value=value).flip(1)
