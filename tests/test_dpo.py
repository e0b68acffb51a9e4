"""DPO: the loss by hand, its gradient, the data module, a tiny-model fit, the config."""

import json
import math
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from lit_grpo.algorithms.dpo import DPOModule
from lit_grpo.data.preferences import PreferenceDataModule, encode_completions
from lit_grpo.data.tasks import SLIPS, arithmetic, arithmetic_preferences, slip_kind
from lit_grpo.model.policy import LoraSpec, PolicySpec
from lit_grpo.objectives import dpo_loss, sequence_logps

REPO_ROOT = Path(__file__).resolve().parents[1]
LN3 = math.log(3.0)


# ------------------------------------------------------------------ the loss
def test_dpo_loss_hand_computed():
    # beta=0.5, references 0:
    # pair 0: chosen 2ln3, rejected 0 -> rewards (ln3, 0), margin ln3, sigmoid 3/4 -> loss ln(4/3)
    # pair 1: chosen -1, rejected 1 -> rewards (-0.5, 0.5), margin -1 -> loss log(1 + e)
    chosen, rejected = torch.tensor([2 * LN3, -1.0]), torch.tensor([0.0, 1.0])
    out = dpo_loss(chosen, rejected, torch.zeros(2), torch.zeros(2), beta=0.5)
    torch.testing.assert_close(out.loss, torch.tensor((math.log(4 / 3) + math.log(1 + math.e)) / 2))
    torch.testing.assert_close(out.metrics["rewards/chosen"], torch.tensor((LN3 - 0.5) / 2))
    torch.testing.assert_close(out.metrics["rewards/rejected"], torch.tensor(0.25))
    torch.testing.assert_close(out.metrics["rewards/margin"], torch.tensor((LN3 - 1.0) / 2))
    torch.testing.assert_close(out.metrics["rewards/accuracy"], torch.tensor(0.5))  # pair 0 only


def test_dpo_loss_is_relative_to_the_reference():
    # Policy == reference: every reward is 0 -> loss ln2, no pair counted as won;
    # the policy alone prefers chosen in pair 0 only (-1 > -2, -3 < -2).
    policy_chosen, policy_rejected = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.0])
    out = dpo_loss(policy_chosen, policy_rejected, policy_chosen, policy_rejected)
    torch.testing.assert_close(out.loss, torch.tensor(math.log(2.0)))
    assert out.metrics["rewards/accuracy"] == 0.0
    assert out.metrics["logps/accuracy"] == 0.5


def test_label_smoothing_hand_computed():
    # margin ln3: (1 - 0.25) * -log(3/4) + 0.25 * -log(1/4) = 0.75 ln(4/3) + 0.25 ln4
    out = dpo_loss(torch.tensor([LN3]), torch.zeros(1), torch.zeros(1), torch.zeros(1), beta=1.0, label_smoothing=0.25)
    torch.testing.assert_close(out.loss, torch.tensor(0.75 * math.log(4 / 3) + 0.25 * math.log(4.0)))


def test_gradient_pushes_chosen_up_and_rejected_down():
    # d/d chosen of -log sigmoid(beta * (chosen - rejected)) = -beta * (1 - sigmoid(margin)):
    # beta=0.5, margin ln3 -> -0.5 * 1/4 = -0.125; rejected gets +0.125. Gradient
    # descent therefore raises chosen and lowers rejected; the reference gets none.
    chosen = torch.tensor([2 * LN3], requires_grad=True)
    rejected = torch.zeros(1, requires_grad=True)
    ref = torch.zeros(1, requires_grad=True)
    dpo_loss(chosen, rejected, ref, torch.zeros(1), beta=0.5).loss.backward()
    torch.testing.assert_close(chosen.grad, torch.tensor([-0.125]))
    torch.testing.assert_close(rejected.grad, torch.tensor([0.125]))
    torch.testing.assert_close(ref.grad, torch.tensor([0.125]))  # treated as data: no_grad in the module


def test_large_margins_stay_finite():
    out = dpo_loss(torch.tensor([1e4]), torch.tensor([-1e4]), torch.zeros(1), torch.zeros(1))
    assert torch.isfinite(out.loss) and out.loss < 1e-6


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"beta": 0.0}, "beta must be > 0"),
        ({"label_smoothing": 0.5}, "label_smoothing"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2), **kwargs)


def test_mismatched_shapes():
    with pytest.raises(ValueError, match="same \\[B\\] shape"):
        dpo_loss(torch.zeros(2), torch.zeros(3), torch.zeros(2), torch.zeros(2))


def test_sequence_logps_ignores_padding():
    # row 0: -1 + -2 (third is padding, even inf is ignored); row 1: nothing real -> 0
    logprobs = torch.tensor([[-1.0, -2.0, -math.inf], [-5.0, -5.0, -5.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    torch.testing.assert_close(sequence_logps(logprobs, mask), torch.tensor([-3.0, 0.0]))


# -------------------------------------------------------------------- data
def test_arithmetic_preferences_pairs():
    rows = arithmetic_preferences(50, seed=3, ops="+")
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in arithmetic(50, seed=3, ops="+")]
    for row in rows:
        a, b = map(int, row["prompt"].removeprefix("What is ").removesuffix("?").split(" + "))
        right = str(a + b)
        assert row["chosen"] == f"{a} + {b} = {right}" and row["answer"] == right
        swapped = right[:-2] + right[-1] + right[-2]  # 85 -> 58, 122 -> 122 (no slip)
        slips = ({str(a + b + d) for d in (1, -1, 10, -10)} | {str(int(swapped))}) - {right}
        assert row["rejected"].removeprefix(f"{a} + {b} = ") in slips


def test_arithmetic_preferences_draw_the_slips_asked_for():
    every = arithmetic_preferences(200, seed=3, ops="+")
    assert arithmetic_preferences(200, seed=3, ops="+", slips=list(SLIPS)) == every  # the default, draw for draw
    for kinds in (["off_by_1"], ["off_by_10"], ["off_by_1", "swapped"]):
        rows = arithmetic_preferences(200, seed=3, ops="+", slips=kinds)
        assert [r["prompt"] for r in rows] == [r["prompt"] for r in every]  # the same questions
        drawn = {slip_kind(int(r["answer"]), int(r["rejected"].split("= ")[1])) for r in rows}
        assert drawn == set(kinds)
    assert slip_kind(85, 86) == "off_by_1" and slip_kind(85, 75) == "off_by_10" and slip_kind(85, 58) == "swapped"
    with pytest.raises(ValueError, match=r"slips=\['off_by_2'\]; expected a non-empty list"):
        arithmetic_preferences(5, seed=0, slips=["off_by_2"])


def test_arithmetic_preferences_draw_weighted_slips_in_their_proportions():
    rows = arithmetic_preferences(4000, seed=3, ops="+", slips={"off_by_1": 3, "off_by_10": 1})
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in arithmetic_preferences(4000, seed=3, ops="+")]
    kinds = [slip_kind(int(r["answer"]), int(r["rejected"].split("= ")[1])) for r in rows]
    assert set(kinds) == {"off_by_1", "off_by_10"}
    assert 0.72 < kinds.count("off_by_1") / len(kinds) < 0.78  # 3 : 1, where unweighted it is 1 : 1
    for bad in ({"off_by_1": 0}, {"off_by_2": 1}, {"off_by_1": "3"}, {}):
        with pytest.raises(ValueError, match=r"slips=.*or a mapping of those kinds to positive weights"):
            arithmetic_preferences(5, seed=0, slips=bad)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_missing_column_is_named(tmp_path):
    source = write_jsonl(tmp_path / "pairs.jsonl", [{"question": "q", "good": "a", "bad": "b"}] * 4)
    data = PreferenceDataModule(source=source, val_size=1, columns={"prompt": "question", "chosen": "good"})
    with pytest.raises(ValueError, match="no 'rejected' column.*'bad'"):
        data.setup("fit")


def test_column_map_and_message_lists(tmp_path):
    rows = [
        {
            "q": f"q{i}",
            "good": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "yes"}],
            "rejected": "no",
        }
        for i in range(5)
    ]
    data = PreferenceDataModule(
        source=write_jsonl(tmp_path / "p.jsonl", rows), val_size=2, columns={"prompt": "q", "chosen": "good"}
    )
    data.setup("fit")
    assert len(data.train_rows) == 3 and data.val_rows[0]["prompt"] == "q0"


def test_encode_completions_appends_eos_and_truncates(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids, mask = encode_completions(tokenizer, ["12 + 3 = 15", "1"], max_length=None)
    lengths = mask.sum(-1)
    assert ids[0, lengths[0] - 1] == ids[1, lengths[1] - 1] == tokenizer.eos_token_id
    assert (ids[1, lengths[1] :] == tokenizer.pad_token_id).all()
    with pytest.raises(ValueError, match="max_completion_length=2"):
        encode_completions(tokenizer, ["12 + 3 = 15"], max_length=2)
    with pytest.warns(UserWarning, match="truncated"):
        ids, mask = encode_completions(tokenizer, ["12 + 3 = 15"], max_length=2, overflow="truncate")
    assert ids.shape == (1, 2) and tokenizer.eos_token_id not in ids


# ----------------------------------------------------------- tiny-model fit
def test_tiny_model_learns_the_preferences(tiny_model_dir):
    # 8 pairs seen 12 times over (24 steps of 4 pairs), validated on the same 8
    # (a built-in task regenerates the same rows for val_split). Before training
    # the policy is its reference: every implicit reward is 0, accuracy 0, loss ln2.
    # Full fine-tuning: a LoRA adapter on a 32-wide random model learns too slowly
    # for a unit test, and this covers the frozen-copy reference.
    torch.manual_seed(0)
    module = DPOModule(
        policy=PolicySpec(name_or_path=tiny_model_dir, lora=None),
        beta=0.5,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        progress=False,
    )
    data = PreferenceDataModule(train_size=8, val_split="train", val_size=8, batch_size=4, val_batch_size=8)
    trainer = L.Trainer(
        max_epochs=12,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=100,
    )
    (before,) = trainer.validate(module, data, verbose=False)
    assert before["val/rewards/accuracy"] == 0 and abs(before["val/loss"] - math.log(2)) < 1e-5
    reference = {k: v.clone() for k, v in module.reference.state_dict().items()}
    trainer.fit(module, data)
    (after,) = trainer.validate(module, data, verbose=False)
    assert after["val/rewards/accuracy"] == 1.0 and after["val/rewards/margin"] > 1.0
    assert after["val/loss"] < 0.1 < before["val/loss"]
    assert after["val/logps/accuracy"] > before["val/logps/accuracy"]
    assert all(torch.equal(v, module.reference.state_dict()[k]) for k, v in reference.items())


def test_lora_reference_is_the_base_model(tiny_model_dir):
    # A fresh LoRA adapter is a no-op (B = 0); once B moves, the policy's
    # log-probs change and the adapter-disabled reference's must not.
    module = DPOModule(policy=PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8)))
    module.configure_model()
    generator = torch.Generator().manual_seed(0)
    batch = {
        "prompt_ids": torch.randint(0, 500, (4, 5), generator=generator),
        "prompt_mask": torch.ones(4, 5, dtype=torch.long),
        "completion_ids": torch.randint(0, 500, (4, 3), generator=generator),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]),
    }
    with torch.no_grad():
        base = module.sequence_logps(module.policy, batch)  # [4]
        for name, param in module.policy.named_parameters():
            if "lora_B" in name:
                param.normal_(generator=generator)
        with module.reference_model() as reference:
            assert not reference.training
            ref = module.sequence_logps(reference, batch)
        policy = module.sequence_logps(module.policy, batch)
    assert module.policy.training  # restored after scoring the reference
    torch.testing.assert_close(ref, base, rtol=0, atol=1e-6)
    assert (policy - base).abs().min() > 1e-3


# ----------------------------------------------------------------- the CLI
def test_quickstart_config_parses():
    config = REPO_ROOT / "configs" / "dpo_quickstart.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "lit_grpo.cli", "dpo", "fit", "--config", str(config), "--print_config"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = yaml.safe_load(done.stdout)
    assert printed["model"]["policy"]["name_or_path"] == "embedded"
    assert printed["data"]["source"] == "arithmetic_preferences"
    assert printed["export_adapter"] == "runs/dpo_quickstart/adapter"
