"""Training on episodes end to end (GRPOModule + OnPolicyDataModule with tools) on a tiny random Llama.

The random model's calls are scripted (see tests/test_episodes.py): its turns
end at a space, which about half of its sampled tokens hold, and always call
the configured calculator.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from test_episodes import Scripted

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.algorithms.ppo import PPOModule
from lit_grpo.data.episodes import EpisodesSpec
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.specs import AdvantageSpec, HeldOutSpec, SourceSpec
from lit_grpo.environments import ToolCall
from lit_grpo.generation.rollout import SamplingSpec
from lit_grpo.model.policy import PolicySpec

CALCULATOR = "lit_grpo.environments.builtin.calculator"


class Calls(Scripted):
    def parse(self, text: str):
        return [ToolCall("calculator", {"expression": "1 + 2"})] if self.stop in text else []


def answer_length(prompts, completions, **columns):
    """Reads text or TRL's conversational completions (the last message's content)."""
    return [float(len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]


def make(tiny_model_dir, fmt=None, module_class=GRPOModule, module_args=None, **data):
    module_args = {"policy": PolicySpec(name_or_path=tiny_model_dir), **(module_args or {})}
    module = module_class(progress=False, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), **module_args)
    settings = dict(
        prompts_per_epoch=2,
        batch_size=4,
        source=SourceSpec(train_size=40),
        held_out=HeldOutSpec(size=4, batch_size=4),
        sampling=SamplingSpec(group_size=4, max_new_tokens=8),
        rewards=[answer_length],
    )
    settings.update(data)
    episode_keys = [key for key in settings if key in EpisodesSpec.__dataclass_fields__]
    settings["episodes"] = EpisodesSpec(**{key: settings.pop(key) for key in episode_keys})
    datamodule = OnPolicyDataModule(**settings)
    if fmt is not None:
        datamodule.episodes.format = fmt
    return module, datamodule


def fit(tmp_path, module, data, epochs=2, **kwargs):
    options = dict(
        max_epochs=epochs,
        reload_dataloaders_every_n_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    trainer = L.Trainer(**options)
    trainer.fit(module, data)
    return trainer


def adapter(module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.policy.named_parameters() if p.requires_grad}


def test_tools_that_are_never_called_train_to_the_same_adapter_bitwise(tmp_path, tiny_model_dir):
    torch.manual_seed(0)
    plain, data = make(tiny_model_dir)
    fit(tmp_path / "plain", plain, data)
    torch.manual_seed(0)
    tools, data = make(tiny_model_dir, fmt=Scripted("\x00never written\x00"), tools=[CALCULATOR])
    trainer = fit(tmp_path / "tools", tools, data)
    assert trainer.callback_metrics["episode/tool_calls"] == 0
    assert trainer.callback_metrics["episode/turns_mean"] == 1
    ours, theirs = adapter(tools), adapter(plain)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert any(v.abs().sum() > 0 for k, v in ours.items() if "lora_B" in k)  # it trained (B starts at 0)


@pytest.mark.parametrize(
    "setting",
    [
        dict(),
        dict(num_iterations=2, dynamic_sampling=True, max_sampling_rounds=2),
        dict(advantage=AdvantageSpec("rloo"), loss_type="dapo"),
        dict(advantage=AdvantageSpec("reinforce_pp"), loss_type="bnpo"),
        dict(checkpointing=True, loss_type="dr_grpo"),
    ],
    ids=["grpo", "mu2-dynamic", "rloo-dapo", "reinforce_pp", "checkpointing"],
)
def test_a_tool_run_trains_logs_episode_metrics_and_writes_each_turn(tmp_path, tiny_model_dir, setting):
    setting = dict(setting)
    module_args = {k: setting.pop(k) for k in ("loss_type",) if k in setting}
    checkpointing = setting.pop("checkpointing", False)
    if checkpointing:
        module_args["policy"] = PolicySpec(name_or_path=tiny_model_dir, gradient_checkpointing=True)
    module, data = make(
        tiny_model_dir,
        fmt=Calls(" "),
        module_args=module_args,
        tools=[CALCULATOR],
        max_turns=2,
        max_episode_tokens=40,
        **setting,
    )
    trainer = fit(tmp_path, module, data, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    metrics = trainer.callback_metrics
    assert metrics["episode/tool_calls"] > 0 and metrics["episode/turns_mean"] > 1
    for key in (
        "episode/tool_errors",
        "episode/tool_timeouts",
        "episode/tool_seconds",
        "episode/budget_cut_fraction",
        "train/loss",
        "completion/length_mean",
    ):
        assert key in metrics and torch.isfinite(metrics[key]), key
    rows = data.last_result.rows
    assert (rows["completion_attention"] > rows["completion_mask"]).any()  # tool tokens were there
    assert (rows["sampler_logprobs"][rows["completion_mask"] == 0] == 0).all()
    samples = [json.loads(line) for line in next(tmp_path.rglob("samples.jsonl")).read_text().splitlines()]
    assert any(s.get("turns") and s["turns"][1]["role"] == "tool" and s["turns"][1]["content"] == "3" for s in samples)
    assert any(v.abs().sum() > 0 for k, v in adapter(module).items() if "lora_B" in k)


def test_ppo_refuses_episodes_in_one_line_saying_why(tmp_path, tiny_model_dir):
    module, data = make(
        tiny_model_dir,
        module_class=PPOModule,
        tools=[CALCULATOR],
        sampling=SamplingSpec(group_size=1, max_new_tokens=8),
        batch_size=2,
    )
    with pytest.raises(ValueError, match="PPOModule: its critic"):
        fit(tmp_path, module, data)


def test_a_tool_run_resumed_inside_an_epoch_ends_where_the_straight_run_does(tmp_path, tiny_model_dir):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(ckpt_path=None):
        torch.manual_seed(0)
        module, data = make(
            tiny_model_dir, fmt=Calls(" "), tools=[CALCULATOR], max_turns=2, max_episode_tokens=40, batch_size=2
        )  # 4 optimizer steps per epoch
        saving = ModelCheckpoint(tmp_path / "checkpoints", every_n_train_steps=1, save_top_k=-1)
        trainer = L.Trainer(
            max_epochs=2,
            reload_dataloaders_every_n_epochs=1,
            accelerator="cpu",
            logger=False,
            callbacks=[saving] if ckpt_path is None else [],
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
            num_sanity_val_steps=0,
        )
        trainer.fit(module, data, ckpt_path=ckpt_path)
        return module, data

    straight, data = run()
    assert data.last_result.stats["episode/tool_calls"] > 0
    inside = tmp_path / "checkpoints" / "epoch=1-step=6.ckpt"  # 2 of epoch 1's 4 steps taken
    state = torch.load(inside, weights_only=False)
    assert any("rollout" in v for k, v in state.items() if "OnPolicyDataModule" in k)  # the epoch's episodes
    resumed, _ = run(ckpt_path=inside)
    ours, theirs = adapter(resumed), adapter(straight)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


class Guesses(Scripted):
    def parse(self, text: str):
        return [ToolCall("guess", {"number": 5})] if self.stop in text else []


def test_an_environment_per_episode_owns_the_reward_and_its_reset_joins_the_prompt(tmp_path, tiny_model_dir):
    module, data = make(
        tiny_model_dir,
        fmt=Guesses(" "),
        source=SourceSpec("guess_number", task_args={"low": 1, "high": 10}, train_size=40),
        environment={"class_path": "lit_grpo.environments.builtin.GuessNumber", "init_args": {"max_guesses": 2}},
        rewards=[],
        max_turns=3,
        max_episode_tokens=60,
        turn_prefix="guess(",
    )
    trainer = fit(tmp_path, module, data, epochs=1)
    assert "reward/environment" in trainer.callback_metrics
    assert "Call the guess tool" in data.format_prompts(data.train_rows[:1])[0]
    turns = [m for sample in data.last_result.samples for m in sample[3] if m["role"] == "tool"]
    assert turns and all(m["content"].startswith(("higher", "lower", "correct", "No guesses")) for m in turns)
    later = [
        m
        for sample in data.last_result.samples
        for before, m in zip(sample[3], sample[3][1:])
        if before["role"] == "tool"
    ]  # data.episodes.turn_prefix opens every turn after a tool result
    assert later and all(m["role"] == "assistant" and m["content"].startswith("guess(") for m in later)
    with pytest.raises(
        ValueError,
        match=r"data.episodes.turn_prefix='guess\(' without data.episodes.tools or data.episodes.environment",
    ):
        EpisodesSpec(turn_prefix="guess(")
    with pytest.raises(ValueError, match="data.rewards is empty and data.episodes.environment has no get_reward"):
        OnPolicyDataModule(episodes=EpisodesSpec(tools=[CALCULATOR]), rewards=[])
