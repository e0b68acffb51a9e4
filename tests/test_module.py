"""GRPOModule + OnPolicyDataModule end to end on a tiny random Llama (seconds each)."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from tqdm.auto import tqdm

from lit_grpo.algorithms.grpo import GRPOModule
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.specs import HeldOutSpec, SourceSpec
from lit_grpo.generation.rollout import SamplingSpec
from lit_grpo.model.logprob_passes import completion_logprobs
from lit_grpo.model.policy import PolicySpec
from lit_grpo.training.summary import PhaseLine


def length_reward(prompts, completions, **columns):
    """Varies within every group of a random model, so advantages are non-zero."""
    return [float(len(c)) for c in completions]


def constant_reward(prompts, completions, **columns):
    return [1.0] * len(completions)


def make(tiny_model_dir, reward=length_reward, beta=0.04, **data):
    module = GRPOModule(
        policy=PolicySpec(name_or_path=tiny_model_dir),
        beta=beta,
        progress=False,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    settings = dict(
        prompts_per_epoch=2,
        batch_size=4,
        source=SourceSpec(train_size=40),
        held_out=HeldOutSpec(size=4, batch_size=4),
        sampling=SamplingSpec(group_size=4, max_new_tokens=6),
        rewards=[reward],
    )
    settings.update(data)
    return module, OnPolicyDataModule(**settings)


def trainer(tmp_path, epochs=2, **kwargs):
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
    return L.Trainer(**options)


def test_two_epoch_fit_logs_rollout_and_validation(tmp_path, tiny_model_dir):
    module, data = make(tiny_model_dir)
    fit = trainer(tmp_path)
    fit.fit(module, data)
    metrics = fit.callback_metrics
    for key in (
        "train/loss",
        "reward/total",
        "reward/length_reward",
        "val/accuracy",
        "train/kl",
        "rollout/collapsed_fraction",
        "completion/length_mean",
        "time/generate",
    ):
        assert key in metrics and torch.isfinite(metrics[key]), key
    assert fit.global_step == 4  # 2 epochs x (2 prompts x 4 samples / batch 4)
    assert data.position == 4  # two epochs took two prompts each
    # the bar shows what a policy-gradient run moves, not its loss (~0 by construction)
    shown = set(fit.progress_bar_metrics)
    assert {"reward/total", "train/kl", "val/accuracy"} <= shown and not any("loss" in k for k in shown)


def test_lora_step_changes_adapter_not_base(tmp_path, tiny_model_dir):
    module, data = make(tiny_model_dir)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    trainer(tmp_path, epochs=1).fit(module, data)
    after = dict(module.policy.named_parameters())
    lora = [n for n in before if "lora_" in n]
    assert lora and any(not torch.equal(before[n], after[n]) for n in lora)
    assert all(torch.equal(before[n], after[n]) for n in before if "lora_" not in n)


def test_reference_logprobs_equal_base_model(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    module, data = make(tiny_model_dir)
    trainer(tmp_path, epochs=1).fit(module, data)  # the adapter is no longer zero
    rows = {k: v for k, v in _one_rollout(module, data).items()}
    size = data.hparams.batch_size  # the rows rollout_logprobs scores together
    reference = module.rollout_logprobs(rows, temperature=0.8, reference=True, batch_size=size)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        expected = torch.cat(
            [
                completion_logprobs(
                    base,
                    *(
                        rows[k][i : i + size]
                        for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
                    ),
                    0.8,
                )[0]
                for i in range(0, len(rows["prompt_ids"]), size)
            ]
        )
    mask = rows["completion_mask"].bool()
    assert torch.equal(reference[mask], expected[mask])
    policy = module.rollout_logprobs(rows, temperature=0.8, reference=False)
    assert not torch.equal(policy[mask], expected[mask])


def _one_rollout(module, data):
    from lit_grpo.generation.rollout import generate

    ids, mask = data.encode(data.train_rows[:2])
    rollout = generate(module.policy, module.tokenizer, ids, mask, data.sampling)
    return {
        "prompt_ids": rollout.prompt_ids,
        "prompt_mask": rollout.prompt_mask,
        "completion_ids": rollout.completion_ids,
        "completion_mask": rollout.completion_mask,
        "advantages": torch.zeros(len(rollout.texts)),
    }


class GradientRecorder(L.Callback):
    def __init__(self):
        self.norms = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        grads = [p.grad for p in module.trainable_parameters() if p.grad is not None]
        self.norms.append(float(torch.stack([g.abs().max() for g in grads]).max()))


@pytest.mark.parametrize("skip", [True, False])
def test_beta_zero_and_collapsed_groups_give_exactly_zero_gradient(tmp_path, tiny_model_dir, skip):
    module, data = make(tiny_model_dir, reward=constant_reward, beta=0.0)
    module.hparams.skip_zero_gradient_rows = skip  # skipped rows, or a full pass whose gradient is 0
    recorder = GradientRecorder()
    trainer(tmp_path, epochs=1, callbacks=[recorder]).fit(module, data)
    assert recorder.norms and all(norm == 0.0 for norm in recorder.norms)
    assert float(module.trainer.callback_metrics["rollout/collapsed_fraction"]) == 1.0


def first_group_collapsed(prompts, completions, **columns):
    """Group 0 of each rollout gets equal rewards (zero advantage), the others vary."""
    rewards = [float(len(c)) for c in completions]
    return [1.0] * 4 + rewards[4:]


@pytest.mark.parametrize("oversampling, rounds, drawn", [(1.0, 2, 8), (1.5, 1, 6)])
def test_dynamic_sampling_replaces_collapsed_groups_and_oversampling_spares_the_next_round(
    tmp_path, tiny_model_dir, oversampling, rounds, drawn
):
    # 4 prompts a round, group 0 of each round collapsed: 3 groups with signal from the first round,
    # so a second round (4 more prompts) fills the fourth; sampling 6 prompts leaves 5 with signal.
    module, data = make(
        tiny_model_dir,
        reward=first_group_collapsed,
        prompts_per_epoch=4,
        batch_size=16,
        dynamic_sampling=True,
        max_sampling_rounds=3,
        oversampling=oversampling,
    )
    trainer(tmp_path, epochs=1).fit(module, data)
    metrics = module.trainer.callback_metrics
    assert float(metrics["rollout/rounds"]) == rounds and data.position == drawn
    assert float(metrics["rollout/collapsed_fraction"]) == 0.0  # the trained groups all have signal


def test_oversampling_without_dynamic_sampling_is_refused():
    with pytest.raises(ValueError, match=r"data.oversampling=2.0 needs data.dynamic_sampling: true"):
        OnPolicyDataModule(oversampling=2.0)


class FullGradient(L.Callback):
    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.grads = [p.grad.clone() for p in module.trainable_parameters()]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_skipping_zero_gradient_rows_leaves_the_step_unchanged(tmp_path, tiny_model_dir, loss_type):
    grads = []
    for skip in (True, False):
        L.seed_everything(0)
        module = GRPOModule(
            policy=PolicySpec(name_or_path=tiny_model_dir),
            beta=0.0,
            loss_type=loss_type,
            skip_zero_gradient_rows=skip,
            progress=False,
        )
        data = OnPolicyDataModule(
            prompts_per_epoch=4,
            batch_size=16,
            held_out=HeldOutSpec(size=4),
            source=SourceSpec(train_size=40),
            sampling=SamplingSpec(group_size=4, max_new_tokens=6),
            rewards=[first_group_collapsed],
        )
        recorder = FullGradient()
        trainer(tmp_path, epochs=1, callbacks=[recorder]).fit(module, data)
        assert float(module.trainer.callback_metrics["rollout/collapsed_fraction"]) == 0.25
        grads.append(recorder.grads)
    assert any(g.abs().sum() > 0 for g in grads[1])
    for skipped, full in zip(*grads):
        torch.testing.assert_close(skipped, full, rtol=1e-5, atol=1e-7)


def test_resume_continues_at_epoch_and_prompt_position(tmp_path, tiny_model_dir):
    module, data = make(tiny_model_dir)
    first = trainer(
        tmp_path,
        epochs=2,
        enable_checkpointing=True,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)],
    )
    first.fit(module, data)
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert not any("lora_" not in key for key in checkpoint["state_dict"])  # no frozen base weights
    module2, data2 = make(tiny_model_dir)
    second = trainer(tmp_path, epochs=3)
    seen = {}

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.setdefault("epoch", trainer.current_epoch)
            seen.setdefault("position", data2.position)

    second.callbacks.append(Probe())
    second.fit(module2, data2, ckpt_path=tmp_path / "last.ckpt")
    assert seen["epoch"] == 2
    assert seen["position"] == 6  # 2 epochs restored (4) + this epoch's 2 prompts, taken by its rollout
    lora = {k: v for k, v in module.policy.state_dict().items() if "lora_" in k}
    assert lora


def test_exported_adapter_reloads_to_identical_logprobs(tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    module, data = make(tiny_model_dir)
    trainer(tmp_path, epochs=1).fit(module, data)
    path = module.export_adapter(tmp_path / "adapter")
    assert (path / "adapter_config.json").exists()
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), path).eval()
    rows = _one_rollout(module, data)
    ours = module.rollout_logprobs(rows, temperature=0.8, reference=False)
    with torch.no_grad():
        theirs, _ = completion_logprobs(
            reloaded, rows["prompt_ids"], rows["prompt_mask"], rows["completion_ids"], rows["completion_mask"], 0.8
        )
    mask = rows["completion_mask"].bool()
    assert torch.equal(ours[mask], theirs[mask])


def test_user_built_trainer_with_own_logger_and_callbacks(tmp_path, tiny_model_dir):
    module, data = make(tiny_model_dir)
    logger = CSVLogger(tmp_path, name="mine")
    lr_monitor = L.pytorch.callbacks.LearningRateMonitor()
    fit = trainer(tmp_path, epochs=2, logger=logger, callbacks=[lr_monitor])
    fit.fit(module, data)
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    columns = set(rows[0])
    assert {"reward/total", "val/accuracy", "train/loss_epoch", "lr-AdamW"} <= columns
    first_val = [r for r in rows if r.get("val/accuracy")][0]
    assert first_val["step"] == "0"  # the accuracy before any training is logged too
    assert (Path(logger.log_dir) / "samples.jsonl").exists()


@pytest.mark.parametrize(
    "bar, shown",
    [(TQDMProgressBar, tqdm), (RichProgressBar, PhaseLine), (None, PhaseLine)],
    ids=["tqdm", "rich", "none"],
)
def test_rollout_progress_follows_the_trainers_bar(bar, shown, tmp_path):
    # a tqdm bar beside Lightning's tqdm bar; lines without a bar, and under the rich bar, whose live
    # display holds a tqdm bar's output back until a newline the bar never writes
    module = GRPOModule(progress=True)
    module.trainer = L.Trainer(
        accelerator="cpu",
        callbacks=[bar()] if bar else [],
        enable_progress_bar=bar is not None,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    progress = module.show_progress("rollout", 4)
    assert isinstance(progress, shown)
    progress.close()


def test_a_phase_line_reports_while_the_phase_runs_and_when_it_ends(capsys):
    line = PhaseLine("rollout", "step", total=3, every=0.0)  # a line at every update
    line.update(2)
    line.close()
    line.close()  # closed once
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("rollout: 2/3 steps, ") and out[1].startswith("rollout: 2 steps in ") and len(out) == 2


@pytest.mark.integration
def test_embedded_model_trains_two_epochs(tmp_path):
    module = GRPOModule(progress=False)
    data = OnPolicyDataModule(
        prompts_per_epoch=2,
        batch_size=8,
        held_out=HeldOutSpec(size=2),
        source=SourceSpec(train_size=20, task_args={"ops": "+"}),
        sampling=SamplingSpec(group_size=4, max_new_tokens=8),
    )
    fit = trainer(tmp_path, epochs=2, check_val_every_n_epoch=2)
    fit.fit(module, data)
    metrics = fit.callback_metrics
    assert torch.isfinite(metrics["train/loss"]) and 0.0 <= float(metrics["val/accuracy"]) <= 1.0
    assert float(metrics["completion/length_mean"]) > 0
