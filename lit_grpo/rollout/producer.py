"""The rollout producer: prompts in, a scored and versioned rollout out.

One rollout round reads top to bottom: sample G completions per prompt from
the policy's engine, score them with the rewards, add the reference and old
log-probs where the objective reads them, and turn the rewards into
advantages. The result, :class:`ScoredRollout`, carries its rows (tensors,
one per completion), statistics, a few samples to log, and the version of
the policy that sampled it.

With dynamic sampling (DAPO) groups whose rewards are all equal carry no
signal; they are replaced by groups of fresh prompts for up to
``max_sampling_rounds`` rounds, and if signal is still short the rollout is
topped up with collapsed groups so every rank trains on the same number of
rows (a DDP requirement).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from lit_grpo.environments.factory import ENVIRONMENT_REWARD, environment_rewards
from lit_grpo.generation.episodes import episode_stats
from lit_grpo.generation.rollout import Rollout, SamplingSpec
from lit_grpo.objectives import group_advantages
from lit_grpo.rewards import RewardCombiner, TrainerState
from lit_grpo.rollout.estimators import ESTIMATORS, AdvantageInputs
from lit_grpo.rollout.policy import RolloutPolicy
from lit_grpo.training.throughput import completion_pairs, rollout_tokens

# Rollout statistics whose value over all ranks is their maximum (the rest are means).
MAX_STATS = ("completion/length_max",)


@dataclass
class ScoredRollout:
    """One rank's scored rollout.

    Attributes:
        rows: Tensors with one row per completion: ``prompt_ids``,
            ``prompt_mask``, ``completion_ids``, ``completion_mask``,
            ``sampler_logprobs``, ``rewards``, ``advantages``, and where they
            apply ``completion_attention``, ``ref_logprobs``,
            ``old_logprobs``, ``values``, ``returns``.
        stats: Its statistics (reward, lengths, timings, ...) to log once.
        samples: ``(prompt, completion, reward[, an episode's messages])`` to log.
        version: The policy version (optimizer steps taken) that sampled it.
        counts: What the model read to make it, for the FLOP and bandwidth counts:
            ``tokens``, ``pairs``, ``decode_pairs`` (the completions' pairs),
            ``decode_steps`` (over all sampling rounds), ``generated`` tokens,
            ``kept`` tokens, and ``reference``/``old`` (which scoring passes ran, 0 or 1).
    """

    rows: dict[str, Tensor]
    stats: dict[str, float]
    samples: list[tuple]
    version: int
    counts: dict[str, float]


@dataclass
class Request:
    """Prompts made ready for sampling: the rows, tokenized, and their episodes' set-up."""

    prompts: list[dict]
    prompt_ids: Tensor  # [B, P]
    prompt_mask: Tensor  # [B, P]
    episodes: object | None = None  # an EpisodePlan with tools or an environment
    environments: list | None = None  # each episode's environment (None where it has none)


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


class RolloutProducer:
    """Samples, scores and estimates advantages for one rank's prompts.

    Args:
        sampling: How completions are sampled (group size, temperature, ...).
        rewards: The reward functions and their weights.
        estimator: A key of :data:`~lit_grpo.rollout.estimators.ESTIMATORS`.
        encode: ``(rows, repeat) -> (prompt_ids, prompt_mask, episodes, environments)``:
            the chat-formatted, tokenized prompts, and for episodes their
            :class:`~lit_grpo.generation.episodes.EpisodePlan` and environments
            (``None, None`` without).
        reply: The sampled texts as the replies read (the completion prefix in front).
        advantage_scale: ``data.advantage.scale``, read by ``grpo``.
        batch_size: Rows scored together by a pass of the policy.
        num_iterations: Optimisation passes over each rollout.
        dynamic_sampling: Replace groups whose rewards are all equal.
        max_sampling_rounds: Most rounds dynamic sampling may spend.
        multi_objective_aggregation: ``data.advantage.multi_objective_aggregation``, read by ``grpo``.
    """

    def __init__(
        self,
        sampling: SamplingSpec,
        rewards: RewardCombiner,
        estimator: str,
        encode: Callable,
        reply: Callable[[list[str]], list],
        advantage_scale: str = "group",
        batch_size: int = 32,
        num_iterations: int = 1,
        dynamic_sampling: bool = False,
        max_sampling_rounds: int = 4,
        multi_objective_aggregation: str = "sum_then_normalize",
    ) -> None:
        self.sampling, self.rewards, self.estimator = sampling, rewards, estimator
        self.multi_objective_aggregation = multi_objective_aggregation
        self.encode, self.reply = encode, reply
        self.advantage_scale, self.batch_size, self.num_iterations = advantage_scale, batch_size, num_iterations
        self.rounds = max_sampling_rounds if dynamic_sampling else 1
        self.dynamic_sampling = dynamic_sampling

    @property
    def kl_in_rewards(self) -> bool:
        """Whether the estimator puts the KL to the reference into its per-token rewards."""
        return ESTIMATORS[self.estimator].kl_weight is not None

    def produce(
        self,
        draw: Callable[[], list[dict]],
        policy: RolloutPolicy,
        *,
        count: int,
        missing_on_any_rank: Callable[[int], bool],
        accumulate: int,
        epoch: int,
        first: tuple[Request, Rollout, int] | None = None,
        generator: torch.Generator | None = None,
        stats: dict[str, float] | None = None,
        trainer_state: TrainerState | None = None,
    ) -> ScoredRollout:
        """Run one rollout round for this rank.

        Args:
            draw: The next prompts of this rank (called once per sampling round).
            policy: What samples and scores (see :class:`RolloutPolicy`).
            count: Prompts (groups) this rank trains on.
            missing_on_any_rank: Whether any rank still misses groups with
                signal, given this rank's count (a collective under DDP).
            accumulate: Micro-batches per optimizer step.
            epoch: For the warning about empty completions.
            first: The first round sampled already, ahead of training:
                ``(request, rollout, the policy version that sampled it)``;
                ``None`` samples it now with the policy's engine. Dynamic
                sampling's further rounds are sampled now either way.
            generator: Randomness of the rounds sampled now (``None``: torch's global generator).
            stats: Statistics of the sampling ahead, logged with the rollout's.
            trainer_state: Where training is, for the rewards that read ``trainer_state``.
        """
        G = self.sampling.group_size
        version = policy.policy_version if first is None else first[2]
        timings = {"generate": 0.0, "reward": 0.0}
        kept: list[_Group] = []
        spare: list[_Group] = []
        sampled = {"generated": 0, "decode_steps": 0}  # tokens sampled, and decode steps run, over the rounds
        logged: dict[str, list[float]] = {}  # the rewards' log_metric calls

        def log_metric(name: str, value: float) -> None:
            logged.setdefault(name, []).append(float(value))

        for round_index in range(self.rounds):
            if round_index == 0 and first is not None:
                request, rollout, _ = first
            else:
                request = self.prepare(draw())
                steps = (
                    self.sampling.max_new_tokens if request.episodes is None else request.episodes.max_episode_tokens
                )
                label = "rollout"
                if round_index:  # dynamic sampling: the groups whose completions all scored the same are replaced
                    label = f"resampling {round_index}/{self.rounds - 1}: {count - len(kept)} groups had equal rewards"
                rollout = self.sample(request, policy.engine, generator, progress=policy.show_progress(label, steps))
            timings["generate"] += rollout.seconds
            sampled["generated"] += int(rollout.lengths.sum())
            sampled["decode_steps"] += rollout.completion_ids.shape[1]
            supplied = {"trainer_state": trainer_state, "log_metric": log_metric}
            for group in self._score(request, rollout, timings, supplied):
                collapsed = self.dynamic_sampling and bool(group_advantages(group.rewards, G).collapsed[0])
                (spare if self.dynamic_sampling and collapsed else kept).append(group)
            if not missing_on_any_rank(max(count - len(kept), 0)):
                break
        result = self._complete(
            (kept + spare)[:count],
            policy,
            timings,
            accumulate,
            epoch,
            version,
            sampled,
            rounds=round_index + 1,
        )
        result.stats.update({name: sum(values) / len(values) for name, values in logged.items()})
        if first is not None:
            result.stats.update(stats or {})
            result.stats["rollout/staleness"] = float(policy.policy_version - version)
            # the rounds sampled in line (dynamic sampling's further ones) kept the trainer waiting too
            in_line = timings["generate"] - first[1].seconds
            result.stats["time/rollout_wait"] = result.stats.get("time/rollout_wait", 0.0) + in_line
        return result

    def prepare(self, prompts: list[dict]) -> Request:
        """Chat-format and tokenize ``prompts`` (and start their episodes) for sampling: on the main thread."""
        return Request(prompts, *self.encode(prompts, self.sampling.group_size))

    def sample(self, request: Request, engine, generator: torch.Generator | None = None, progress=None) -> Rollout:
        """G completions of each of the request's prompts from ``engine`` (a
        :class:`~lit_grpo.generation.Engine` or a frozen sampler of one); ``generator``:
        its randomness (``None``: torch's global generator)."""
        extra = {} if generator is None else {"generator": generator}
        if request.episodes is not None:  # episodes with prompts of their own complete once each
            extra["repeat"] = request.episodes.repeat(request.prompt_ids.shape[0])
        return engine.generate(
            request.prompt_ids,
            request.prompt_mask,
            self.sampling,
            episodes=request.episodes,
            progress=progress,
            **extra,
        )

    def _score(self, request: Request, rollout: Rollout, timings: dict, supplied: dict) -> list[_Group]:
        """The rewards of a sampled round, one group per prompt (``supplied``: what rewards may name
        beside the columns, :data:`~lit_grpo.rewards.base.SUPPLIED`; the completions' ids and the
        episodes' environments are added here)."""
        G, prompts, spec = self.sampling.group_size, request.prompts, request.episodes
        start = time.perf_counter()
        rows = [row for row in prompts for _ in range(G)]
        columns = {key: [row.get(key) for row in rows] for key in rows[0] if key != "prompt"}
        columns["completion_length"] = rollout.lengths.tolist()
        if spec is None:
            completions = self.reply(rollout.texts)
        else:  # TRL's conversational completions; text rewards read the final answers
            completions = [record.messages for record in rollout.episodes]
            columns[ENVIRONMENT_REWARD] = environment_rewards(request.environments)
        tokens = rollout.completion_mask if spec is None else rollout.completion_attention  # [N, C]
        supplied = {
            **supplied,
            "completion_ids": [ids[real.bool()].tolist() for ids, real in zip(rollout.completion_ids, tokens)],
            "environments": list(request.environments or [None] * len(rows)),
        }
        scores = self.rewards.score([r["prompt"] for r in rows], completions, columns, supplied)
        timings["reward"] += time.perf_counter() - start
        groups = []
        for i, prompt in enumerate(prompts):
            s = slice(i * G, (i + 1) * G)
            groups.append(
                _Group(
                    rollout.prompt_ids[s],
                    rollout.prompt_mask[s],
                    rollout.completion_ids[s],
                    rollout.completion_mask[s],
                    rollout.truncated[s],
                    rollout.logprobs[s],
                    scores.total[s],
                    {name: values[s] for name, values in scores.per_function.items()},
                    _prompt_text(prompt["prompt"]),
                    rollout.texts[s],
                    None if spec is None else rollout.completion_attention[s],
                    None if spec is None else rollout.episodes[s],
                )
            )
        return groups

    def _complete(
        self,
        groups: list[_Group],
        policy: RolloutPolicy,
        timings: dict,
        accumulate: int,
        epoch: int,
        version: int,
        sampled: dict[str, int],
        rounds: int,
    ) -> ScoredRollout:
        _warn_if_all_empty(groups, epoch)
        rows, stats = self._assemble(groups, policy, timings, accumulate, stale=policy.policy_version != version)
        stats.update(_rollout_stats(groups, self.sampling.group_size))
        stats["rollout/tokens_per_s"] = sampled["generated"] / max(timings["generate"], 1e-9)
        stats["rollout/generated_tokens"] = float(sampled["generated"])  # dynamic sampling's dropped groups included
        stats["rollout/rounds"] = float(rounds)
        stats.update({f"time/{name}": seconds for name, seconds in timings.items()})
        samples = [
            (g.prompt, self.reply(g.texts[:1])[0], float(g.rewards[0]))
            + ((g.episodes[0].messages,) if g.episodes else ())
            for g in groups[:2]
        ]
        if groups[0].episodes is not None:
            stats.update(episode_stats([record for g in groups for record in g.episodes]))
        return ScoredRollout(rows, stats, samples, version, _counts(rows, sampled))

    def _assemble(self, groups: list[_Group], policy: RolloutPolicy, timings: dict, accumulate: int, stale: bool):
        sampling = self.sampling
        pad = policy.tokenizer.pad_token_id
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
            length_stats["rollout/masked_token_fraction"] = (
                1 - (rows["completion_mask"].sum() / sampled.sum().clamp(min=1)).item()
            )
        rewards = torch.cat([g.rewards for g in groups])  # [N]
        options = policy.estimator_options()
        estimator = ESTIMATORS[self.estimator]
        start = time.perf_counter()
        if policy.needs_reference:
            rows["ref_logprobs"] = policy.rollout_logprobs(rows, sampling.temperature, True, self.batch_size)
            timings["reference"] = time.perf_counter() - start
        steps_per_rollout = len(rewards) // self.batch_size // accumulate
        if self.num_iterations > 1 or steps_per_rollout > 1 or estimator.reads_old_logprobs(options) or stale:
            # The policy moves between optimizer steps on this rollout, so pi_old must
            # be frozen now; with a single step pi_old = pi_theta and the training
            # step uses its own detached log-probs instead (no extra forward pass).
            # A rollout sampled by older weights (ahead of training) is scored by the
            # current ones: the ratio's anchor, with the sampler's gap corrected apart.
            start = time.perf_counter()
            rows["old_logprobs"] = policy.rollout_logprobs(rows, sampling.temperature, False, self.batch_size)
            timings["old_logprobs"] = time.perf_counter() - start
        per_reward = torch.stack(
            [torch.cat([g.per_function[name] for g in groups]) for name in groups[0].per_function], dim=-1
        )  # [N, K]
        weights = torch.tensor([weight for _, _, weight in self.rewards.entries])  # [K]
        inputs = AdvantageInputs(
            sampling.group_size,
            self.advantage_scale,
            options,
            self.batch_size,
            per_reward,
            weights,
            self.multi_objective_aggregation,
        )
        estimated, stats = estimator.compute(rewards, rows, inputs, policy)
        rows.update(estimated)
        rows["rewards"] = rewards
        stats.update(length_stats)
        return rows, stats


def _warn_if_all_empty(groups: list[_Group], epoch: int) -> None:
    # Not an error: a policy can pass through this and recover. But when it happens
    # from the first epoch on, the chat template or the EOS tokens are usually wrong.
    if any(text.strip() for group in groups for text in group.texts):
        return
    warnings.warn(
        f"epoch {epoch}: all {sum(len(g.texts) for g in groups)} completions are empty (the policy "
        "ended every answer at once), so the rewards cannot tell them apart and only the KL term "
        "trains. Expected some text; check policy.name_or_path's chat template and EOS tokens, "
        "data.prompt.template and sampling.temperature.",
        RuntimeWarning,
        stacklevel=3,
    )


def _rollout_stats(groups: list[_Group], G: int) -> dict[str, float]:
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


def _counts(rows: dict[str, Tensor], sampled: dict[str, int]) -> dict[str, float]:
    attention = rows.get("completion_attention", rows["completion_mask"])
    tokens, pairs = rollout_tokens(rows["prompt_ids"], rows["prompt_mask"], attention)
    return {
        "tokens": tokens,
        "pairs": pairs,
        "decode_pairs": completion_pairs(rows["prompt_mask"], attention),
        "decode_steps": float(sampled["decode_steps"]),
        "generated": float(sampled["generated"]),
        "kept": float(attention.sum()),
        "reference": float("ref_logprobs" in rows),
        "old": float("old_logprobs" in rows),
    }


def _right_pad(tensors: list[Tensor], value: int) -> Tensor:
    rows = [row for t in tensors for row in t]
    return pad_sequence(rows, batch_first=True, padding_value=value)


def _left_pad(tensors: list[Tensor], value: int) -> Tensor:
    rows = [row.flip(0) for t in tensors for row in t]
    return pad_sequence(rows, batch_first=True, padding_value=value).flip(1)


def _prompt_text(prompt) -> str:
    """A prompt for the samples file: text as it is, a conversation's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1] if users else prompt)
