"""Code written for TRL's GRPOTrainer, run through lit_grpo's Python API under a plain Lightning Trainer.

TRL's conventions, taken as they come: a ``datasets.Dataset`` of conversational
prompts as the source, tools as Python functions (sync or async), an
environment class or factory (``environment_factory``), and reward functions
that name ``environments``, ``completion_ids``, ``trainer_state`` or
``log_metric``, or take ``**kwargs``.
"""

from __future__ import annotations

import asyncio

import lightning as L
import pytest
import torch
from datasets import Dataset, DatasetDict
from trl_2048 import PROMPT, Game2048, reward_score

from lit_grpo import (
    EpisodesSpec,
    GRPOModule,
    HeldOutSpec,
    LoraSpec,
    OnPolicyDataModule,
    PolicySpec,
    PromptSpec,
    SamplingSpec,
    SourceSpec,
)
from lit_grpo.rewards import RewardCombiner, TrainerState, accuracy


def module(tiny_model_dir) -> GRPOModule:
    torch.manual_seed(0)
    return GRPOModule(
        policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8)),
        progress=False,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )


def fit(tmp_path, module, data, epochs: int = 2, **options) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        reload_dataloaders_every_n_epochs=1,
        default_root_dir=tmp_path,
        **options,
    )
    trainer.fit(module, data)
    return trainer


def small(**options) -> OnPolicyDataModule:
    settings = dict(
        held_out=HeldOutSpec(size=2),
        prompts_per_epoch=2,
        batch_size=4,
        prompt=PromptSpec(max_length=512),
        sampling=SamplingSpec(group_size=2, max_new_tokens=6),
    )
    return OnPolicyDataModule(**{**settings, **options})


def test_trls_2048_environment_class_and_a_reward_reading_environments_train_two_epochs(tmp_path, tiny_model_dir):
    seen = []

    def recorded(environments, **kwargs):
        seen.append(environments)
        return reward_score(environments, **kwargs)

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": PROMPT}] for _ in range(12)]})
    data = small(
        source=SourceSpec(dataset),
        rewards=[recorded],
        held_out=HeldOutSpec(size=2, reward=reward_score),
        episodes=EpisodesSpec(environment=Game2048, max_turns=2, max_episode_tokens=24),
    )
    trainer = fit(tmp_path, module(tiny_model_dir), data)
    assert trainer.global_step == 2
    assert len(seen) == 2 and all(len(envs) == 4 and all(isinstance(e, Game2048) for e in envs) for envs in seen)
    assert len({id(env) for envs in seen for env in envs}) == 8  # a fresh game per episode
    assert "val/accuracy" in trainer.callback_metrics  # validation scored by the same reward, its games' scores
    assert "Play 2048" in data.format_prompts(data.train_rows[:1])[0]  # the conversation went through the template


def test_an_environment_factory_builds_each_episodes_game(tmp_path, tiny_model_dir):
    built = []

    def factory():
        built.append(Game2048())
        return built[-1]

    data = small(
        source=SourceSpec([{"prompt": PROMPT}] * 10),
        rewards=[reward_score],
        held_out=HeldOutSpec(size=2, reward=reward_score),
        episodes=EpisodesSpec(environment=factory, max_turns=1, max_episode_tokens=12),
    )
    fit(tmp_path, module(tiny_model_dir), data, epochs=1, limit_val_batches=0)
    assert len(built) >= 4


def multiply(a: int, b: int) -> int:
    """Multiplies two numbers.

    Args:
        a: The first.
        b: The second.
    """
    CALLS.append((a, b))
    return a * b


async def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: The first.
        b: The second.
    """
    await asyncio.sleep(0)
    CALLS.append(("add", a, b))
    return a + b


CALLS: list = []


def test_tools_given_as_functions_are_called(tiny_model_dir):
    from lit_grpo.data.episodes import EpisodeSetup
    from lit_grpo.environments import ToolCall

    setup = EpisodeSetup(EpisodesSpec(tools=[multiply, add, "lit_grpo.environments.builtin.calculator"]), 32)
    assert setup.toolbox.names == ["multiply", "add", "calculator"]
    results = setup.toolbox.run([ToolCall("multiply", {"a": 6, "b": 7}), ToolCall("add", {"a": 2, "b": 3})])
    assert [r.content for r in results] == ["42", "5"] and CALLS[-2:] == [(6, 7), ("add", 2, 3)]


def test_a_reward_naming_trainer_state_sees_the_global_step_advance(tmp_path, tiny_model_dir):
    steps, logged = [], []

    def curriculum(completions, completion_ids, trainer_state, log_metric, **kwargs):
        steps.append((trainer_state.global_step, trainer_state.epoch, trainer_state.max_steps))
        assert len(completion_ids) == len(completions) and all(isinstance(t, int) for t in completion_ids[0])
        log_metric("curriculum/level", float(trainer_state.global_step))
        logged.append(True)
        return [float(len(ids)) for ids in completion_ids]

    trainer = fit(
        tmp_path,
        module(tiny_model_dir),
        small(source=SourceSpec(train_size=20), rewards=[curriculum]),
        epochs=3,
        limit_val_batches=0,
    )
    assert steps == [(0, 0, 3), (1, 1, 3), (2, 2, 3)]
    assert float(trainer.callback_metrics["curriculum/level"]) == 2.0


def test_async_rewards_are_awaited_together():
    order = []

    async def slow(prompts, completions, **kwargs):
        order.append("slow starts")
        await asyncio.sleep(0.05)
        order.append("slow ends")
        return [1.0] * len(completions)

    async def fast(prompts, completions, **kwargs):
        order.append("fast starts")
        return [2.0] * len(completions)

    scores = RewardCombiner([slow, fast]).score(["p"] * 2, ["a", "b"], {}, {"trainer_state": TrainerState(0, 0)})
    assert scores.total.tolist() == [3.0, 3.0]
    assert order.index("fast starts") < order.index("slow ends")  # concurrently, not one after the other


def test_a_dataset_dict_and_a_list_of_rows_train(tmp_path, tiny_model_dir):
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(20)]
    splits = DatasetDict({"train": Dataset.from_list(rows[4:]), "test": Dataset.from_list(rows[:4])})
    data = small(
        source=SourceSpec(splits, columns={"prompt": "question"}),
        held_out=HeldOutSpec(split="test", size=2),
        rewards=[accuracy],
    )
    assert fit(tmp_path, module(tiny_model_dir), data, epochs=1).global_step == 1
    assert len(data.train_rows) == 16 and len(data.val_rows) == 2
    data = small(source=SourceSpec(rows, columns={"prompt": "question"}), rewards=[accuracy])
    assert fit(tmp_path / "list", module(tiny_model_dir), data, epochs=1, limit_val_batches=0).global_step == 1


def unknown_argument(completions, judge_model, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"source": SourceSpec(Dataset.from_dict({"question": ["q"] * 8}))},
            r"data.source.dataset='<a Dataset of 8 rows>' has no 'prompt' column; map one with data.source.columns",
        ),
        (
            {"rewards": [unknown_argument]},
            r"Reward 'unknown_argument' takes the argument 'judge_model', which lit_grpo cannot supply: a reward may "
            r"take prompts, completions, completion_ids, environments, trainer_state, log_metric and the columns",
        ),
        (
            {"episodes": EpisodesSpec(environment=lambda: object())},
            r"data.episodes.environment: .*<lambda> returns a object, which has no reset\(self, \*\*row\) method",
        ),
    ],
)
def test_trl_shaped_mistakes_get_one_line_naming_the_field(tiny_model_dir, options, message):
    with pytest.raises(ValueError, match=message):
        data = small(**options)
        data.setup("fit")


def test_rows_that_are_not_row_dicts_are_refused_when_the_source_is_built():
    with pytest.raises(ValueError, match=r"data.source.dataset is a list of 2 items; expected a non-empty list of row"):
        SourceSpec([1, 2])
