"""The SFT -> RM -> GRPO pipeline: its three shipped configs run one after the other on a tiny model.

Each stage is the command its config documents, with the model swapped for
the tiny one and the sizes cut: ``sft fit`` exports an adapter, ``rm fit``
trains on it (``policy.init_adapter``) and exports the reward model, and
``fit --config configs/grpo_rm.yaml`` starts from the same adapter and is
scored by the reward model on its own base (``shared_base``).
"""

from __future__ import annotations

import json
from pathlib import Path

from lit_grpo.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def common(tiny_model_dir: str, root: Path) -> list[str]:
    return [
        f"--model.policy.name_or_path={tiny_model_dir}",
        "--model.policy.lora.r=4",
        "--model.policy.lora.alpha=8",
        f"--trainer.default_root_dir={root}",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--model.progress=false",
        f"--export_adapter={root / 'out'}",
    ]


def test_sft_then_reward_model_then_grpo_scored_by_it(tmp_path, tiny_model_dir, capsys):
    sft, rm, grpo = tmp_path / "sft", tmp_path / "rm", tmp_path / "grpo"
    main(
        [
            "sft",
            "fit",
            "--config",
            str(CONFIGS / "sft_quickstart.yaml"),
            *common(tiny_model_dir, sft),
            "--data.train_size=8",
            "--data.val_size=4",
            "--data.val_max_new_tokens=4",
        ]
    )
    assert (sft / "out" / "adapter_model.safetensors").is_file()
    main(
        [
            "rm",
            "fit",
            "--config",
            str(CONFIGS / "rm_quickstart.yaml"),
            *common(tiny_model_dir, rm),
            f"--model.policy.init_adapter={sft / 'out'}",
            "--data.train_size=8",
            "--data.val_size=4",
        ]
    )
    assert (rm / "out" / "config.json").is_file() and (rm / "out" / "adapter" / "reward_head.safetensors").is_file()
    rewards = [
        {
            "class_path": "lit_grpo.rewards.RewardModel",
            "init_args": {"name_or_path": str(rm / "out"), "shared_base": True},
        },
        {"class_path": "lit_grpo.rewards.Accuracy", "init_args": {"weight": 0.0}},
    ]
    main(
        [
            "fit",
            "--config",
            str(CONFIGS / "grpo_rm.yaml"),
            *common(tiny_model_dir, grpo),
            f"--model.policy.init_adapter={sft / 'out'}",
            f"--data.rewards={json.dumps(rewards)}",
            "--trainer.max_epochs=1",
            "--trainer.callbacks=[]",
            "--model.validate_before_training=false",
            "--data.source.train_size=20",
            "--data.held_out.size=4",
            "--data.held_out.slices={}",
            "--data.prompts_per_epoch=2",
            "--data.batch_size=4",
            "--data.sampling.group_size=2",
            "--data.sampling.max_new_tokens=4",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={grpo}",
            "--model.progress=true",  # no progress bar: each phase prints its line
        ]
    )
    assert "reward model reward_model: 4 completions in " in capsys.readouterr().out
    assert (grpo / "out" / "adapter_model.safetensors").is_file()
    (metrics,) = grpo.rglob("metrics.csv")
    header, *rows = [line.split(",") for line in metrics.read_text().splitlines()]
    logged = [dict(zip(header, row)) for row in rows]
    # the reward model scored the rollout; the verifier's accuracy was logged beside it at weight 0
    assert any(row.get("reward/reward_model") for row in logged) and any(row.get("reward/accuracy") for row in logged)
