"""The DataModule's side of episodes: tools and environments from YAML, prompts that describe
them, one environment per episode, and rewards that read the episode.

``data.episodes.tools`` (dotted paths of typed, documented functions) and
``data.episodes.environment`` (``class_path`` + ``init_args``, TRL's
``environment_factory`` contract) turn every completion into an episode
(:mod:`lit_grpo.generation.episodes`). The tools are described to the model
in the chat template's own way (:func:`lit_grpo.environments.call_format`);
an environment's ``reset`` text joins the user message. Rewards follow TRL's
conversational convention: a reward function gets ``completions`` as each
episode's messages (assistant and tool turns); lit_grpo's built-in rewards,
written for text, get the last assistant turn's text (the final answer). An
environment's ``get_reward()`` is a reward of its own, ``environment``,
weighted by ``data.episodes.environment_reward_weight``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit_grpo.data.prompts import prompt_messages
from lit_grpo.environments import TemplateFormat, Toolbox, call_format
from lit_grpo.environments.factory import ENVIRONMENT_REWARD, EnvironmentFactory
from lit_grpo.generation.episodes import EpisodePlan
from lit_grpo.generation.rollout import encode_prompts
from lit_grpo.rewards import BUILTINS, FromCallable, Reward, RewardCombiner


@dataclass
class EpisodesSpec:
    """Tools and a multi-turn environment: with either, every completion becomes an episode.

    Args:
        tools: Tools the model may call: typed functions with Google-style
            docstrings, as dotted paths (``lit_grpo.environments.builtin.calculator``)
            or, in Python, the functions themselves (sync or ``async def``), as
            TRL's ``tools=[...]``.
        environment: A multi-turn environment, ``{class_path, init_args}``, or in
            Python the class or any zero-argument factory (TRL's
            ``environment_factory``): one instance per episode, its
            ``reset(**row)`` text added to the prompt, its methods the episode's
            tools, its ``get_reward()`` a reward. One init arg can be set from
            the command line: ``--data.episodes.environment.init_args.max_guesses=3``.
        max_turns: Most assistant turns per episode.
        tool_timeout: Seconds one tool call may run before its result is a timeout error.
        max_episode_tokens: Most tokens after the prompt, the model's and the
            tools' (``sampling.max_new_tokens`` counts the model's only);
            ``None``: twice ``sampling.max_new_tokens``.
        turn_prefix: Text every assistant turn after a tool result starts
            with, as ``data.prompt.completion_prefix`` is for the first (for example the
            call's first words, so that later turns call too): appended to the
            tool results as tokens the policy reads and is not trained on.
        environment_reward_weight: Weight of the environment's ``get_reward()``.
    """

    tools: list[str] | None = None
    environment: dict[str, Any] | None = None
    max_turns: int = 3
    tool_timeout: float = 10.0
    max_episode_tokens: int | None = None
    turn_prefix: str = ""
    environment_reward_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"data.episodes.max_turns={self.max_turns}; expected >= 1.")
        if self.turn_prefix and not self.active:
            raise ValueError(
                f"data.episodes.turn_prefix={self.turn_prefix!r} without data.episodes.tools or "
                "data.episodes.environment; expected episodes (its text starts each turn after a "
                "tool result)."
            )

    @property
    def active(self) -> bool:
        """Whether completions are episodes (tools or an environment are set)."""
        return bool(self.tools) or self.environment is not None


class EnvironmentReward(Reward):
    """The environment's own ``get_reward()`` at the end of each episode, as a weighted reward."""

    default_name = "environment"

    def __call__(self, prompts: list[str], completions: list, **columns: Any) -> list[float | None]:
        return list(columns[ENVIRONMENT_REWARD])


class _Episodic(Reward):
    """A reward over episodes: the messages, or for a text reward the final answers."""

    def __init__(self, function, name: str, weight: float, reads_text: bool) -> None:
        super().__init__(weight, name)
        self.function, self.reads_text = function, reads_text
        self.required_columns = tuple(getattr(function, "required_columns", ()))

    def __call__(self, prompts: list[str], completions: list, **columns: Any) -> list[float | None]:
        if self.reads_text:
            completions = [_answer(messages) for messages in completions]
        return self.function(prompts=prompts, completions=completions, **columns)


def _answer(messages: list[dict]) -> str:
    return next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")


def _reads_text(function) -> bool:
    """lit_grpo's own rewards score text; everything else gets TRL's conversational completions."""
    if isinstance(function, FromCallable):
        return function.function in BUILTINS.values()
    owner = type(function).__module__ if isinstance(function, Reward) else getattr(function, "__module__", "")
    return (owner or "").startswith("lit_grpo.")


class EpisodeSetup:
    """Tools and/or an environment, built (and checked) from ``data.episodes``.

    Args:
        spec: The :class:`EpisodesSpec`.
        max_episode_tokens: Most tokens after the prompt, tools' included (the spec's, or its default).
    """

    def __init__(self, spec: EpisodesSpec, max_episode_tokens: int) -> None:
        self.toolbox = Toolbox.from_config(spec.tools, timeout=spec.tool_timeout) if spec.tools else None
        self.factory = None
        environment = spec.environment
        if isinstance(environment, dict):
            if "class_path" not in environment:
                raise ValueError(
                    f"data.episodes.environment={environment!r}; expected {{class_path: ..., init_args: {{...}}}}."
                )
            # jsonargparse files --data.episodes.environment.init_args.NAME=VALUE as environment[NAME] (a
            # dict-typed field): such keys are init args set on the command line, over the config's.
            given = {name: value for name, value in environment.items() if name not in ("class_path", "init_args")}
            self.factory = EnvironmentFactory(
                environment["class_path"], {**(environment.get("init_args") or {}), **given}, timeout=spec.tool_timeout
            )
        elif environment is not None:  # in Python: a class or a factory, as TRL's environment_factory
            self.factory = EnvironmentFactory(environment, timeout=spec.tool_timeout)
        self.max_turns, self.max_episode_tokens, self.turn_prefix = spec.max_turns, max_episode_tokens, spec.turn_prefix
        self.format = None  # the tokenizer's call format, learnt at first use

    def rewards(self, rewards: list, environment_weight: float) -> RewardCombiner:
        """``rewards`` over episodes, plus the environment's own when it has one.

        Raises:
            ValueError: No reward at all (``data.rewards`` empty, no ``get_reward``).
        """
        entries = [
            _Episodic(fn, name, weight, _reads_text(fn))
            for name, fn, weight in (RewardCombiner(rewards).entries if rewards else [])
        ]
        if self.factory is not None and self.factory.has_reward:
            entries.append(EnvironmentReward(environment_weight))
        if not entries:
            raise ValueError(
                "data.rewards is empty and data.episodes.environment has no get_reward(); give the episodes "
                "a reward (a reward function, or an environment that scores them)."
            )
        return RewardCombiner(entries)

    def check(self, rows: list[dict]) -> None:
        """Reset an environment on every row, so a failing ``reset`` stops the run before training."""
        if self.factory is not None:
            self.factory.check(rows)

    def start(self, datamodule, rows: list[dict], repeat: int):
        """Fresh episodes for ``rows``, ``repeat`` per row: ``(prompt_ids, prompt_mask, spec, environments)``.

        ``environments`` holds each episode's environment instance (``None`` without one). The
        episodes of a row share one prompt, unless its environments' ``reset`` texts differ (a game
        dealt at random, as TRL's 2048): then each episode gets its own prompt, and ``prompt_ids``
        holds ``len(rows) * repeat`` rows (:meth:`EpisodePlan.repeat` tells the engine how many
        completions each prompt row gets).
        """
        toolboxes, environments, resets = [], [], []
        for row in rows:
            if self.factory is None:
                toolboxes += [self.toolbox] * repeat
                environments += [None] * repeat
                resets += [None] * repeat
                continue
            started = [self.factory.new(row) for _ in range(repeat)]
            environments += [instance for instance, _, _ in started]
            toolboxes += [box.merged(self.toolbox) if self.toolbox else box for _, _, box in started]
            resets += [text for _, text, _ in started]
        shared = all(len(set(resets[i : i + repeat])) == 1 for i in range(0, len(resets), repeat))
        step = repeat if shared else 1  # one prompt per row, or one per episode
        prompt_rows = rows if shared else [row for row in rows for _ in range(repeat)]
        tokenizer, prompt = datamodule.trainer.lightning_module.tokenizer, datamodule.prompt
        ids, mask = encode_prompts(
            tokenizer,
            self.prompts(datamodule, prompt_rows, resets[::step], toolboxes[::step]),
            prompt.max_length,
            prompt.overflow,
        )
        spec = EpisodePlan(
            toolboxes,
            self.call_format(tokenizer),
            self.max_turns,
            self.max_episode_tokens,
            prompt.completion_prefix,
            self.turn_prefix,
            environments if self.factory else [],
        )
        return ids, mask, spec, environments

    def call_format(self, tokenizer):
        """How ``tokenizer``'s model writes calls (:func:`lit_grpo.environments.call_format`), probed once."""
        if self.format is None:
            self.format = call_format(tokenizer)
        return self.format

    def prompts(
        self,
        datamodule,
        rows: list[dict],
        resets: list[str | None] | None = None,
        toolboxes: list[Toolbox] | None = None,
    ) -> list[str]:
        """Chat-formatted prompts with the tools described (and each row's reset text), the prefix after."""
        tokenizer, prompt = datamodule.trainer.lightning_module.tokenizer, datamodule.prompt
        if resets is None:  # prompts to measure or show: a fresh environment per row
            started = [self.factory.new(row) if self.factory else (None, None, self.toolbox) for row in rows]
            resets, toolboxes = [text for _, text, _ in started], [box for _, _, box in started]
        fmt, texts = self.call_format(tokenizer), []
        for row, reset, toolbox in zip(rows, resets, toolboxes):
            messages = prompt_messages(row["prompt"], prompt.system_prompt, prompt.template, reset)
            messages = fmt.system_prompt(tokenizer, messages, toolbox.schemas)
            extra = {"tools": toolbox.schemas} if isinstance(fmt, TemplateFormat) else {}
            texts.append(
                tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
                + prompt.completion_prefix
            )
        return texts
