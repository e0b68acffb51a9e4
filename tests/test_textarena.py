"""A textarena game through the environment contract, trained under a plain Trainer."""

from __future__ import annotations

import pytest

pytest.importorskip("textarena", reason="needs textarena: pip install textarena")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lit_grpo import (  # noqa: E402
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
from lit_grpo.environments.textarena import TextArenaGame  # noqa: E402

GAME = {"class_path": "lit_grpo.environments.textarena.TextArenaGame", "init_args": {"env_id": "GuessTheNumber-v0"}}


def test_a_game_is_played_move_by_move_and_scores_itself():
    game = TextArenaGame()
    rules = game.reset(seed=3)
    assert "Guess The Number" in rules and not game.done
    answers = [game.move(str(n)) for n in (10, 5, 8)]  # seed 3's number is 8
    assert answers[0].endswith("lower.") and answers[1].endswith("higher.")
    assert game.done and game.get_reward() == 1.0 and "Congratulations" in answers[2] and game.solved
    assert game.move("8") == "The game is over."
    game.reset(seed=3)
    game.move("10")
    assert "already guessed" in game.move("10") and not game.done  # the first invalid move is a warning
    assert "already guessed" in game.move("10") and game.done  # the second ends the game, lost
    assert 0 < game.get_reward() < 1 and not game.solved  # partial credit is not a win (lit-grpo eval's env_success)


def test_it_trains_as_an_environment_from_its_yaml_form(tmp_path, tiny_model_dir):
    rows = [{"prompt": "Play the game: one guess per turn.", "seed": seed} for seed in range(12)]
    data = OnPolicyDataModule(
        source=SourceSpec(rows),
        held_out=HeldOutSpec(size=2, reward=lambda environments, **_: [e.get_reward() for e in environments]),
        prompts_per_epoch=2,
        batch_size=4,
        prompt=PromptSpec(max_length=1024),
        rewards=[],
        episodes=EpisodesSpec(environment=GAME, max_turns=2, max_episode_tokens=32),
        sampling=SamplingSpec(group_size=2, max_new_tokens=8),
    )
    module = GRPOModule(
        policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8)),
        progress=False,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        reload_dataloaders_every_n_epochs=1,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, data)
    assert "reward/environment" in trainer.callback_metrics and trainer.global_step == 1
