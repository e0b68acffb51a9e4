"""Held-out slices (``data.held_out.slices``): questions of a form training never sees, scored and logged apart;
and the task options that make such forms (per-operand digits, a mix of option sets)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lit_grpo.cli import main
from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.sources import load_rows
from lit_grpo.data.specs import HeldOutSpec, SourceSpec
from lit_grpo.data.tasks import arithmetic
from lit_grpo.evaluation.evaluate import main as eval_main
from lit_grpo.evaluation.evaluate import table

SLICE = {"3+2": {"digits": [3, 2]}}


def test_per_operand_digits():
    rows = arithmetic(50, seed=0, digits=[3, 2], ops="+")
    for row in rows:
        a, b = row["prompt"].removeprefix("What is ").removesuffix("?").split(" + ")
        assert (len(a), len(b)) == (3, 2) and int(row["answer"]) == int(a) + int(b)
    assert arithmetic(5, seed=0, digits=2) == arithmetic(5, seed=0, digits=[2, 2])  # one count = both operands
    for bad in ([3], [3, 0], [2, 2, 2]):
        with pytest.raises(ValueError, match=r"task digits=.*expected an integer >= 1, or two of them"):
            arithmetic(5, seed=0, digits=bad)


def operand_digits(row: dict) -> tuple[int, int]:
    a, b = row["prompt"].removeprefix("What is ").removesuffix("?").split(" + ")
    return len(a), len(b)


def test_a_mix_draws_each_option_set_evenly_and_interleaved():
    mix = [{"digits": 2, "ops": "+"}, {"digits": [2, 3], "ops": "+"}]
    rows = load_rows("arithmetic", "train", mix, seed=5, size=9)
    assert [operand_digits(r) for r in rows] == [(2, 2), (2, 3)] * 4 + [(2, 2)]  # 5 + 4, alternating
    assert rows[::2] == arithmetic(5, seed=5, digits=2, ops="+")  # the first set: the unmixed task's rows
    data = OnPolicyDataModule(
        source=SourceSpec(task_args=mix, train_size=100), held_out=HeldOutSpec(size=8, slices=SLICE)
    )
    data.setup()
    assert {operand_digits(r) for r in data.val_rows} == {(2, 2), (2, 3)}
    assert {operand_digits(r) for r in data.val_slices["3+2"]} == {(3, 2)}  # overrides the mix's first set
    with pytest.raises(
        ValueError, match=r"data.source.task_args=\[\]; expected the task's options, or a non-empty list"
    ):
        OnPolicyDataModule(source=SourceSpec(task_args=[], train_size=4)).setup()


def test_slices_are_disjoint_from_training_and_of_their_own_form():
    data = OnPolicyDataModule(
        source=SourceSpec(task_args={"digits": 2, "ops": "+"}, train_size=200),
        held_out=HeldOutSpec(size=16, slices={"2+2": {}, **SLICE}),
    )
    data.setup()
    taken = {row["prompt"] for row in data.train_rows + data.val_rows}
    assert list(data.val_sets()) == ["val/accuracy", "val/2+2/accuracy", "val/3+2/accuracy"]
    # A slice of the training distribution itself keeps only questions training never draws.
    assert len(data.val_slices["2+2"]) == 16 and not taken & {r["prompt"] for r in data.val_slices["2+2"]}
    assert all(r["prompt"].split(" + ")[0][-3:].isdigit() for r in data.val_slices["3+2"])  # ops '+' kept
    assert len(data.val_dataloader()) == 3


def test_a_slice_of_a_small_task_takes_what_it_has():
    # 1-digit sums: 100 questions in all, fewer than the 4 x val_size spare rows a slice asks for first.
    data = OnPolicyDataModule(
        source=SourceSpec(task_args={"digits": 2, "ops": "+"}, train_size=100),
        held_out=HeldOutSpec(size=64, slices={"1+1": {"digits": 1}}),
    )
    data.setup()
    assert len(data.val_slices["1+1"]) == 64
    with pytest.raises(
        ValueError, match=r"data.held_out.slices\['1\+1'\]=.*it has 100 distinct ones.*held_out.size=200"
    ):
        OnPolicyDataModule(
            source=SourceSpec(task_args={"digits": 2, "ops": "+"}, train_size=300),
            held_out=HeldOutSpec(size=200, slices={"1+1": {"digits": 1}}),
        ).setup()


@pytest.mark.parametrize(
    "source, slices, message",
    [
        ("arithmetic", {"a/b": {}}, r"data.held_out.slices\['a/b'\]=\{\}; expected a name without '/'"),
        (
            "arithmetic",
            {"1-digit": {"digits": 1, "ops": "+"}},
            r"data.held_out.slices\['1-digit'\]=.*every question it generates is also a training prompt",
        ),
    ],
)
def test_bad_slices_are_refused_before_any_compute(source, slices, message):
    with pytest.raises(ValueError, match=message):
        OnPolicyDataModule(
            source=SourceSpec(dataset=source, task_args={"digits": 1, "ops": "+"}, train_size=96),
            held_out=HeldOutSpec(size=4, slices=slices),
        ).setup()


def test_slices_of_a_quickstart_config_on_ones_own_file_are_ignored_with_a_warning(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(20)))
    with pytest.warns(
        UserWarning, match=r"data.held_out.slices=.*ignored: they are held-out questions of the built-in"
    ):
        data = OnPolicyDataModule(source=SourceSpec(str(path)), held_out=HeldOutSpec(size=4, slices=SLICE))
    data.setup()
    assert data.val_slices == {} and list(data.val_sets()) == ["val/accuracy"] and len(data.train_rows) == 16


def test_fit_logs_each_slice_before_and_during_training_and_eval_scores_them(tiny_model_dir, tmp_path, capsys):
    """The real CLI (progress bar and CSV logger on): each slice is scored at step 0 and at every validation."""
    slices = json.dumps(SLICE)
    common = [
        f"--model.policy.name_or_path={tiny_model_dir}",
        "--data.held_out.size=4",
        "--data.source.train_size=16",
        "--data.prompts_per_epoch=2",
        "--data.batch_size=4",
        "--data.sampling.group_size=2",
        "--data.sampling.max_new_tokens=4",
        f"--data.held_out.slices={slices}",
    ]
    main(
        [
            "fit",
            "--trainer.accelerator=cpu",
            "--trainer.max_epochs=2",
            "--trainer.reload_dataloaders_every_n_epochs=1",
            "--trainer.num_sanity_val_steps=0",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={tmp_path}",
            *common,
        ]
    )
    out = capsys.readouterr().out + capsys.readouterr().err
    with open(next(Path(tmp_path).rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    for name in ("val/accuracy", "val/3+2/accuracy"):
        logged = [row for row in rows if row.get(name)]
        assert len(logged) == 3, name  # before training, after epoch 0, after epoch 1
        assert not logged[0]["epoch"]  # the step-0 score is logged outside any epoch
    assert "val/3+2/accuracy" in out

    result = eval_main(["--trainer.accelerator=cpu", "--model.progress=false", *common])
    assert result["slices"]["3+2"]["prompts"] == 4 and 0 <= result["slices"]["3+2"]["greedy_accuracy"] <= 1
    lines = table(result).splitlines()
    assert len(lines) == 4 and "| validation |" in lines[2] and "| 3+2 |" in lines[3]
