"""SFT: the loss by hand, the completion-only mask, the data formats, init_adapter's reference."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from peft import PeftModel

from lit_grpo.algorithms.dpo import DPOModule
from lit_grpo.algorithms.sft import SFTModule
from lit_grpo.data.sft import SFTDataModule
from lit_grpo.model.policy import LoraSpec, PolicySpec, load_base_model
from lit_grpo.objectives import sft_loss


def trainer(**kwargs) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return L.Trainer(**{**options, **kwargs})


def attached(module, data) -> SFTDataModule:
    """``data`` set up and reachable from ``module`` as in fit (collate reads the module's tokenizer)."""
    fit = trainer(max_epochs=1)
    fit.strategy.connect(module)
    fit._data_connector.attach_datamodule(module, datamodule=data)
    data.setup("fit")
    return data


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ------------------------------------------------------------------ the loss
def test_sft_loss_hand_computed():
    # kept tokens: row 0 columns 1, 2 (-2, -3), row 1 column 0 (-4) -> loss (2 + 3 + 4) / 3 = 3
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -float("inf")]])
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    torch.testing.assert_close(sft_loss(logprobs, mask).loss, torch.tensor(3.0))
    with pytest.raises(ValueError, match="keeps no token"):
        sft_loss(logprobs, torch.zeros_like(mask))


def test_module_loss_is_the_completion_tokens_nll(tiny_model_dir):
    # Hand-built: the naive reference runs the whole conversation in one pass and
    # averages -log p over exactly the reply's tokens and its EOS, nothing of the prompt.
    module = SFTModule(policy=PolicySpec(name_or_path=tiny_model_dir, lora=None), progress=False)
    module.configure_model()
    rows = [{"prompt": "What is 1 + 2?", "completion": "1 + 2 = 3"}, {"prompt": "Hi", "completion": "Hello there"}]
    data = attached(module, SFTDataModule(source=write_jsonl(Path(tiny_model_dir) / "sft.jsonl", rows * 2), val_size=1))
    batch = data.collate(rows)
    tokenizer = module.tokenizer
    total, count = 0.0, 0
    for i, row in enumerate(rows):
        reply = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        assert batch["completion_ids"][i][batch["loss_mask"][i].bool()].tolist() == reply
        ids = torch.tensor([prompt + reply])
        with torch.no_grad():
            logprobs = module.policy(input_ids=ids).logits.log_softmax(-1)[0]  # [T, V]
        for t in range(len(prompt), len(prompt) + len(reply)):  # token t predicted at position t - 1
            total -= float(logprobs[t - 1, ids[0, t]])
            count += 1
    with torch.no_grad():
        loss = module.batch_loss(batch).loss
    torch.testing.assert_close(loss, torch.tensor(total / count), rtol=1e-5, atol=1e-5)


def test_messages_train_every_assistant_turn_only(tiny_model_dir):
    module = SFTModule(policy=PolicySpec(name_or_path=tiny_model_dir), progress=False)
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    ]
    source = write_jsonl(Path(tiny_model_dir) / "chats.jsonl", [{"messages": messages}] * 3)
    data = attached(module, SFTDataModule(source=source, val_size=1))
    batch = data.collate(data.train_rows[:1])
    trained = batch["completion_ids"][0][batch["loss_mask"][0].bool()]
    untrained = batch["completion_ids"][0][(batch["completion_mask"][0] - batch["loss_mask"][0]).bool()]
    assert module.tokenizer.decode(trained) == "A1<|im_end|>\nA2<|im_end|>\n"
    assert "Q2" in module.tokenizer.decode(untrained) and "Q1" in module.tokenizer.decode(batch["prompt_ids"][0])


def test_prompt_completion_message_lists(tiny_model_dir):
    module = SFTModule(policy=PolicySpec(name_or_path=tiny_model_dir), progress=False)
    rows = [{"prompt": [{"role": "user", "content": "Q"}], "completion": [{"role": "assistant", "content": "A"}]}] * 3
    data = attached(module, SFTDataModule(source=write_jsonl(Path(tiny_model_dir) / "pc.jsonl", rows), val_size=1))
    batch = data.collate(data.train_rows[:1])
    assert module.tokenizer.decode(batch["completion_ids"][0]) == "A<|im_end|>"


@pytest.mark.parametrize(
    "rows, match",
    [
        ([{"prompt": "q", "completion": "a"}] * 2 + [{"prompt": "q", "completion": "  "}], "row 2: the completion"),
        ([{"messages": [{"role": "user", "content": "q"}]}] * 3, "row 0: the completion"),
        ([{"question": "q", "solution": "a"}] * 3, "neither 'prompt' \\+ 'completion' nor 'messages'"),
    ],
)
def test_bad_rows_are_named_before_training(tmp_path, rows, match):
    data = SFTDataModule(source=write_jsonl(tmp_path / "bad.jsonl", rows), val_size=1)
    with pytest.raises(ValueError, match=match):
        data.setup("fit")


# ----------------------------------------------------------- init_adapter
def test_init_adapter_reference_is_the_sft_model(tmp_path, tiny_model_dir):
    # An "SFT adapter" with non-zero B, saved as --export_adapter writes it.
    sft = SFTModule(policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8)), progress=False)
    sft.configure_model()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in sft.policy.named_parameters():
            if "lora_B" in name:
                param.normal_(generator=generator)
    sft.export_adapter(tmp_path / "sft")
    batch = {
        "prompt_ids": torch.randint(0, 500, (3, 5), generator=generator),
        "prompt_mask": torch.ones(3, 5, dtype=torch.long),
        "completion_ids": torch.randint(0, 500, (3, 4), generator=generator),
        "completion_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]),
    }
    spec = PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8))
    raw = load_base_model(spec)
    sft_model = PeftModel.from_pretrained(load_base_model(spec), tmp_path / "sft").eval()
    module = DPOModule(
        policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8), init_adapter=str(tmp_path / "sft"))
    )
    module.configure_model()
    with torch.no_grad(), module.reference_model() as reference:
        ref = module.sequence_logps(reference, batch)
        expected, base = module.sequence_logps(sft_model, batch), module.sequence_logps(raw, batch)
        policy = module.sequence_logps(module.policy, batch)
    torch.testing.assert_close(ref, expected, rtol=0, atol=1e-5)  # the reference IS the SFT model
    assert (ref - base).abs().min() > 1e-3  # and not the raw base
    torch.testing.assert_close(policy, ref, rtol=0, atol=1e-6)  # the new adapter starts as a no-op on top
    assert all(not p.requires_grad for n, p in module.policy.named_parameters() if "lora_" not in n)


def test_full_fine_tuning_on_a_folded_adapter_trains_every_weight(tmp_path, tiny_model_dir):
    # peft freezes the base to load an adapter; the folded model must come back trainable
    sft = SFTModule(policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8)), progress=False)
    sft.configure_model()
    sft.export_adapter(tmp_path / "sft")
    full = SFTModule(policy=PolicySpec(name_or_path=tiny_model_dir, lora=None, init_adapter=str(tmp_path / "sft")))
    full.configure_model()
    trainable = [p for p in full.policy.parameters() if p.requires_grad]
    assert trainable and len(trainable) == len(list(full.policy.parameters()))


def test_init_adapter_that_is_not_an_adapter_is_refused(tiny_model_dir):
    module = SFTModule(policy=PolicySpec(name_or_path=tiny_model_dir, init_adapter=tiny_model_dir))
    with pytest.raises(FileNotFoundError, match="policy.init_adapter=.*not a PEFT adapter folder"):
        module.configure_model()


# ------------------------------------------------------------ tiny-model fit
def test_tiny_model_learns_the_demonstrations(tiny_model_dir):
    # 8 demonstrations seen 10 times (20 steps of 4), validated on the same 8 rows
    # (a built-in task regenerates them for val_split): the held-out loss must fall.
    torch.manual_seed(0)
    module = SFTModule(
        policy=PolicySpec(name_or_path=tiny_model_dir, lora=None),
        progress=False,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    data = SFTDataModule(train_size=8, val_split="train", val_size=8, batch_size=4, val_max_new_tokens=6)
    fit = trainer(max_epochs=10, check_val_every_n_epoch=100)
    (before,) = fit.validate(module, data, verbose=False)
    fit.fit(module, data)
    (after,) = fit.validate(module, data, verbose=False)
    assert after["val/loss"] < 0.5 * before["val/loss"]
    assert 0.0 <= after["val/accuracy"] <= 1.0


def test_tokenizer_without_chat_template_is_refused_at_setup(tiny_model_dir):
    module = SFTModule(policy=PolicySpec(name_or_path=tiny_model_dir), progress=False)
    module.tokenizer.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template, which SFT rows need"):
        attached(module, SFTDataModule(train_size=4, val_size=2))


class _Modes(L.Callback):
    """Records, at each training batch, the policy's modules that are in eval mode."""

    def __init__(self) -> None:
        self.eval_modules: list[list[str]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.eval_modules.append([name for name, m in module.policy.named_modules() if not m.training])


def test_training_runs_in_train_mode_also_when_resumed(tmp_path, tiny_model_dir):
    # from_pretrained returns eval mode and Lightning keeps the modes it finds, so adapter dropout
    # was off wherever nothing switched it on: a resumed run skips the "before" evaluation that did.
    spec = PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8, dropout=0.1))
    modes = _Modes()
    for steps, resume in ((1, False), (2, True)):
        module = SFTModule(policy=spec, progress=False)
        data = SFTDataModule(train_size=8, val_size=4, batch_size=4, val_max_new_tokens=2)
        fit = trainer(max_steps=steps, callbacks=[modes], enable_checkpointing=True, default_root_dir=tmp_path)
        fit.fit(module, data, ckpt_path=str(next(tmp_path.rglob("*.ckpt"))) if resume else None)
    assert modes.eval_modules == [[], []]


def test_before_after_answers_is_refused_by_name_outside_an_on_policy_run(tiny_model_dir):
    from lit_grpo.algorithms.answers import BeforeAfterAnswers

    module = SFTModule(policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4)), progress=False)
    data = SFTDataModule(train_size=4, val_size=2, batch_size=2)
    with pytest.raises(
        ValueError,
        match=r"BeforeAfterAnswers answers the held-out prompts of an on-policy run .* "
        r"not SFTModule with SFTDataModule; leave the callback out",
    ):
        trainer(max_epochs=1, callbacks=[BeforeAfterAnswers()]).fit(module, data)
