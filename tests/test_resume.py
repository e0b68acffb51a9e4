"""Exact resume of the dataset modules (SFT, reward model, DPO): a run resumed from a checkpoint
saved inside an epoch ends with the same weights, bit for bit, as a run that was never
interrupted. (GRPO's runs are killed and resumed at every kind of moment in tests/test_chaos.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


# ---------------------------------------------- dataset modules (SFT, reward model, DPO)
def _dataset_run(kind: str, model_dir: str, root: Path, ckpt_path: Path | None = None) -> dict[str, torch.Tensor]:
    """Two epochs of 3 batches of an SFT, reward-model or DPO run with a checkpoint after every step;
    the trainable weights at the end."""
    import lightning as L

    from lit_grpo.algorithms.dpo import DPOModule
    from lit_grpo.algorithms.reward_model import RewardModelModule
    from lit_grpo.algorithms.sft import SFTModule
    from lit_grpo.data.preferences import PreferenceDataModule
    from lit_grpo.data.reward_pairs import RewardDataModule
    from lit_grpo.data.sft import SFTDataModule
    from lit_grpo.model.policy import LoraSpec, PolicySpec

    module_class, data_class = {
        "sft": (SFTModule, SFTDataModule),
        "rm": (RewardModelModule, RewardDataModule),
        "rm-until": (RewardModelModule, RewardDataModule),
        "dpo": (DPOModule, PreferenceDataModule),
    }[kind]
    policy = PolicySpec(name_or_path=model_dir, lora=LoraSpec(r=4, alpha=8, dropout=0.1))  # dropout draws the RNG
    options, data_options = {}, {"train_size": 12}
    if kind == "rm-until":  # a stage that ends on its accuracy, and the suffix loss from the next one
        options = {"suffix_weight": 1.0, "suffix_stages": [1]}
        data_options = {
            "train_size": 24,
            "curriculum": [
                {"share": 0.5, "task_args": {"slips": ["off_by_1"]}, "until": {"accuracy": 0.5, "pairs": 8}},
                {},
            ],
        }
    module = module_class(policy=policy, progress=False, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), **options)
    data = data_class(val_size=4, batch_size=4, **data_options)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[checkpoints] if ckpt_path is None else [],
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return weights, dict(data.curriculum.ends) if data.curriculum else {}


@pytest.mark.parametrize("kind", ["sft", "rm", "dpo", "rm-until"])
def test_dataset_runs_resume_exactly_from_inside_an_epoch(tmp_path, tiny_model_dir, kind):
    import lightning as L

    L.seed_everything(0)
    straight, ends = _dataset_run(kind, tiny_model_dir, tmp_path / "ckpt")
    assert any(k.endswith("reward_head.weight") for k in straight) == kind.startswith("rm")
    assert (ends == {0: 2}) == (kind == "rm-until")  # epoch 1's stage 0 ended after 2 of its 3 batches
    # rm-until: epochs of 6 batches; in epoch 1 before the stage ended (step 7), as it did (8), after (10)
    steps = (1, 7, 8, 10) if kind == "rm-until" else (1, 5)
    for name in (f"epoch=0-step={steps[0]}", *(f"epoch=1-step={s}" for s in steps[1:])):
        L.seed_everything(123)  # the resumed run must not depend on the global RNG it starts with
        resumed, resumed_ends = _dataset_run(
            kind, tiny_model_dir, tmp_path / "unused", tmp_path / "ckpt" / f"{name}.ckpt"
        )
        assert straight.keys() == resumed.keys() and resumed_ends == ends
        for key in straight:
            assert torch.equal(straight[key], resumed[key]), (name, key)
