"""PPOModule (LoRA actor + a critic: a LoRA adapter on the same frozen base, or a
separate model) and the DataModule's advantage estimators, end to end on a tiny
random Llama."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from lit_grpo.algorithms.grpo import SCORED_KEYS, GRPOModule
from lit_grpo.algorithms.ppo import PPOModule
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.specs import AdvantageSpec, HeldOutSpec, SourceSpec
from lit_grpo.generation.rollout import SamplingSpec
from lit_grpo.model.logprob_passes import completion_hidden_states
from lit_grpo.model.policy import LoraSpec, PolicySpec
from lit_grpo.objectives import gae_advantages, ppo_token_rewards, whiten


def constant_reward(prompts, completions, **columns):
    """A value head can fit it: every state's return is 1 (gamma = 1, no KL)."""
    return [1.0] * len(completions)


def length_reward(prompts, completions, **columns):
    return [float(len(c)) / 10 for c in completions]


def make(tiny_model_dir, reward=constant_reward, group_size=1, lr=1e-2, policy=None, **model):
    module = PPOModule(
        policy=policy or PolicySpec(name_or_path=tiny_model_dir),
        progress=False,
        validate_before_training=False,
        optimizer=lambda p: torch.optim.AdamW(p, lr=lr),
        **model,
    )
    data = OnPolicyDataModule(
        prompts_per_epoch=4,
        batch_size=4,
        num_iterations=2,
        held_out=HeldOutSpec(size=4, batch_size=4),
        source=SourceSpec(train_size=40),
        sampling=SamplingSpec(group_size=group_size, max_new_tokens=6),
        rewards=[reward],
    )
    return module, data


def trainer(tmp_path, epochs, **kwargs):
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
        limit_val_batches=0,
    )
    options.update(kwargs)
    return L.Trainer(**options)


class EpochValueLoss(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_epoch_end(self, trainer, module):
        self.losses.append(float(trainer.callback_metrics["train/value_loss"]))


def test_ppo_trains_actor_critic_and_value_head_not_base(tmp_path, tiny_model_dir):
    L.seed_everything(0)
    module, data = make(tiny_model_dir, reward=length_reward, kl_coef=0.05)  # a reference pass too
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    losses = EpochValueLoss()
    trainer(tmp_path, 3, callbacks=[losses]).fit(module, data)
    after = dict(module.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert any(".lora_B.default." in n for n in changed)  # the actor
    assert any(".lora_B.critic." in n for n in changed)  # the critic
    assert {"value_head.weight", "value_head.bias"} <= changed
    assert all("lora_" in n or n.startswith("value_head.") for n in changed)  # the base stayed frozen
    metrics = module.trainer.callback_metrics
    for key in ("train/value_loss", "train/explained_variance", "train/clip_ratio/region", "rollout/value_mean"):
        assert key in metrics and torch.isfinite(metrics[key]), key


def test_value_loss_falls_on_a_reward_the_critic_can_fit(tmp_path, tiny_model_dir):
    L.seed_everything(0)
    module, data = make(tiny_model_dir, reward=constant_reward, lr=3e-3)
    losses = EpochValueLoss()
    trainer(tmp_path, 3, callbacks=[losses]).fit(module, data)
    assert len(losses.losses) == 3
    assert losses.losses[-1] < 0.5 * losses.losses[0], losses.losses  # seen: 0.71, 0.34, 0.12


class CriticBeforeFirstStep(L.Callback):
    """The critic's values of the rollout, scored again before the first optimizer step."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 0 and not hasattr(self, "values"):
            self.values = module.rollout_values(
                trainer.datamodule.last_result.rows, trainer.datamodule.hparams.batch_size
            )


def test_stored_advantages_are_gae_of_the_stored_values(tmp_path, tiny_model_dir):
    L.seed_everything(0)
    module, data = make(tiny_model_dir, reward=length_reward, group_size=2, gamma=0.9, lam=0.8, kl_coef=0.1)
    critic = CriticBeforeFirstStep()
    trainer(tmp_path, 1, callbacks=[critic]).fit(module, data)
    rows = data.last_result.rows
    mask = rows["completion_mask"]  # [N, C]
    assert rows["advantages"].shape == mask.shape == rows["values"].shape == rows["returns"].shape
    assert torch.equal(rows["values"], critic.values)  # the rollout-time critic's, 0 at padding
    assert torch.equal(rows["values"], rows["values"] * mask) and rows["values"].abs().sum() > 0
    # Recompute the per-token rewards, GAE and whitening from the rollout's rewards and stored rows.
    texts = [
        module.tokenizer.decode(ids[m.bool()], skip_special_tokens=True) for ids, m in zip(rows["completion_ids"], mask)
    ]
    rewards = torch.tensor(length_reward(None, texts))
    token_rewards = ppo_token_rewards(rewards, mask, rows["old_logprobs"], rows["ref_logprobs"], beta=0.1)
    expected = gae_advantages(token_rewards, rows["values"], mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(rows["returns"], expected.returns)
    torch.testing.assert_close(rows["advantages"], whiten(expected.advantages, mask))
    real = mask.bool()
    assert abs(float(rows["advantages"][real].mean())) < 1e-5  # whitened over the real tokens


def _trainable(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def separate_critic(tiny_model_dir, full: bool = False) -> PolicySpec:
    """A critic model of its own: the tiny model again, with a smaller adapter or fully fine-tuned."""
    return PolicySpec(name_or_path=tiny_model_dir, lora=None if full else LoraSpec(r=4, alpha=8))


@pytest.mark.parametrize(
    "every, name, separate",
    [
        ("every_n_epochs", "epoch=0-step=2", False),  # end of epoch 0
        ("every_n_train_steps", "epoch=0-step=1", False),  # inside epoch 0
        ("every_n_train_steps", "epoch=0-step=1", True),
    ],
)
def test_resume_is_exact(tmp_path, tiny_model_dir, every, name, separate):
    L.seed_everything(0)
    critic = separate_critic(tiny_model_dir) if separate else None
    module, data = make(tiny_model_dir, reward=length_reward, kl_coef=0.05, critic=critic)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, **{every: 1})
    trainer(tmp_path, 2, enable_checkpointing=True, callbacks=[checkpoints]).fit(module, data)
    straight = _trainable(module)
    critic_key = (lambda k: k.startswith("critic_model.")) if separate else (lambda k: ".critic." in k)
    assert any(k.startswith("value_head.") for k in straight) and any(critic_key(k) for k in straight)
    assert not any("lora_" not in k and not k.startswith("value_head.") for k in straight)  # no base weights
    L.seed_everything(123)  # the resumed run must not depend on the global RNG it starts with
    module2, data2 = make(tiny_model_dir, reward=length_reward, kl_coef=0.05, critic=critic)
    trainer(tmp_path, 2).fit(module2, data2, ckpt_path=tmp_path / "ckpt" / f"{name}.ckpt")
    resumed = _trainable(module2)
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key


def test_group_size_one_is_accepted_for_ppo_and_refused_for_grpo(tmp_path, tiny_model_dir):
    module, data = make(tiny_model_dir, group_size=1)
    fit = trainer(tmp_path, 1)
    fit.fit(module, data)
    assert data.advantage_estimator == "gae" and fit.global_step == 2  # 4 rows / 4 per batch x 2 passes
    grpo = GRPOModule(policy=PolicySpec(name_or_path=tiny_model_dir), progress=False)
    data = OnPolicyDataModule(
        prompts_per_epoch=4,
        batch_size=4,
        held_out=HeldOutSpec(size=4),
        source=SourceSpec(train_size=40),
        sampling=SamplingSpec(group_size=1, max_new_tokens=6),
        rewards=[constant_reward],
    )
    with pytest.raises(
        ValueError,
        match=r"sampling.group_size=1; expected >= 2 with "
        r"data.advantage.estimator='grpo'",
    ):
        trainer(tmp_path, 1).fit(grpo, data)


def test_estimator_the_module_cannot_train_with_is_refused(tmp_path, tiny_model_dir):
    module = GRPOModule(policy=PolicySpec(name_or_path=tiny_model_dir), progress=False)
    data = OnPolicyDataModule(
        prompts_per_epoch=2,
        batch_size=4,
        held_out=HeldOutSpec(size=4),
        source=SourceSpec(train_size=40),
        advantage=AdvantageSpec(estimator="gae"),
        sampling=SamplingSpec(group_size=2, max_new_tokens=6),
        rewards=[constant_reward],
    )
    with pytest.raises(
        ValueError,
        match=r"data.advantage.estimator='gae'; GRPOModule trains with one of "
        r"\['grpo', 'rloo', 'reinforce_pp'\]",
    ):
        trainer(tmp_path, 1).fit(module, data)


def test_rloo_estimator_trains_grpo_module(tmp_path, tiny_model_dir):
    L.seed_everything(0)
    module = GRPOModule(
        policy=PolicySpec(name_or_path=tiny_model_dir),
        progress=False,
        beta=0.0,
        validate_before_training=False,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    data = OnPolicyDataModule(
        prompts_per_epoch=2,
        batch_size=4,
        held_out=HeldOutSpec(size=4),
        source=SourceSpec(train_size=40),
        advantage=AdvantageSpec(estimator="rloo"),
        sampling=SamplingSpec(group_size=4, max_new_tokens=6),
        rewards=[length_reward],
    )
    trainer(tmp_path, 1).fit(module, data)
    rows = data.last_result.rows
    rewards = rows["advantages"].new_tensor(
        length_reward(
            None,
            [
                module.tokenizer.decode(i[m.bool()], skip_special_tokens=True)
                for i, m in zip(rows["completion_ids"], rows["completion_mask"])
            ],
        )
    )
    group = rewards.view(-1, 4)
    expected = (group - (group.sum(-1, keepdim=True) - group) / 3).view(-1)  # r_i - mean of the other 3
    torch.testing.assert_close(rows["advantages"], expected)
    assert torch.isfinite(module.trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize("full", [False, True], ids=["lora_critic", "full_critic"])
def test_separate_critic_trains_and_its_value_loss_falls(tmp_path, tiny_model_dir, full):
    L.seed_everything(0)
    module, data = make(tiny_model_dir, reward=constant_reward, lr=3e-3, critic=separate_critic(tiny_model_dir, full))
    module.configure_model()
    assert list(module.policy.peft_config) == ["default"]  # no critic adapter on the actor
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    losses = EpochValueLoss()
    trainer(tmp_path, 3, callbacks=[losses]).fit(module, data)
    changed = {n for n, p in module.named_parameters() if not torch.equal(before[n], p)}
    assert any(n.startswith("policy.") and ".lora_B.default." in n for n in changed)  # the actor
    critic = {n for n in changed if n.startswith("critic_model.")}
    assert critic and all(("lora_" in n) != full for n in critic)  # its adapter, or (full) its own weights
    assert {"value_head.weight", "value_head.bias"} <= changed
    assert all("lora_" in n for n in changed if n.startswith("policy."))  # the actor's base stayed frozen
    assert losses.losses[-1] < 0.5 * losses.losses[0], losses.losses


def test_fully_fine_tuned_actor_with_a_separate_critic(tmp_path, tiny_model_dir):
    L.seed_everything(0)
    module, data = make(
        tiny_model_dir,
        reward=length_reward,
        kl_coef=0.05,
        critic=separate_critic(tiny_model_dir),
        policy=PolicySpec(name_or_path=tiny_model_dir, lora=None),
    )
    module.configure_model()
    reference = {n: p.detach().clone() for n, p in module.reference.named_parameters()}
    actor = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    trainer(tmp_path, 1).fit(module, data)
    assert all(torch.equal(reference[n], p) for n, p in module.reference.named_parameters())  # frozen copy
    assert any(not torch.equal(actor[n], p) for n, p in module.policy.named_parameters())
    assert torch.isfinite(module.trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize("separate", [False, True], ids=["shared", "separate"])
def test_export_writes_the_critic_and_its_value_head_beside_the_actor(tmp_path, tiny_model_dir, separate):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    L.seed_everything(0)
    module, data = make(
        tiny_model_dir, reward=length_reward, critic=separate_critic(tiny_model_dir) if separate else None
    )
    trainer(tmp_path, 1).fit(module, data)
    path = module.export_adapter(tmp_path / "export")
    assert (path / "adapter_config.json").is_file() and (path / "tokenizer_config.json").is_file()  # the actor
    # The critic rebuilt from the exported files alone scores as the module's does.
    critic = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), path / "critic").eval()
    head = nn.Linear(critic.config.hidden_size, 1)
    head.load_state_dict(load_file(path / "critic" / "value_head.safetensors"))
    part = {k: data.last_result.rows[k][:4] for k in SCORED_KEYS}
    module.eval()
    with torch.no_grad():
        expected = module.critic_values(**part)  # [4, C]
        values = head(completion_hidden_states(critic, **part)).squeeze(-1)
    torch.testing.assert_close(values, expected)


def test_critic_with_another_vocabulary_and_shared_critic_without_lora_are_refused(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["<an_extra_token>"])
    tokenizer.save_pretrained(tmp_path / "other")
    with pytest.raises(
        ValueError,
        match=r"model.critic.name_or_path='.*other' has another tokenizer than "
        r"model.policy.name_or_path=",
    ):
        PPOModule(
            policy=PolicySpec(name_or_path=tiny_model_dir), critic=PolicySpec(name_or_path=str(tmp_path / "other"))
        )
    with pytest.raises(ValueError, match=r"needs model.policy.lora for its default critic"):
        PPOModule(policy=PolicySpec(name_or_path=tiny_model_dir, lora=None))
