"""The train / held-out split every DataModule shares (lit_grpo.data.sources.split_rows)."""

from __future__ import annotations

import json

import pytest

from lit_grpo.data.grpo import OnPolicyDataModule
from lit_grpo.data.preferences import PreferenceDataModule
from lit_grpo.data.sft import SFTDataModule
from lit_grpo.data.sources import split_rows
from lit_grpo.data.specs import HeldOutSpec, SourceSpec


def numbered(split: str, size: int) -> list[dict]:
    return [{"split": split, "i": i} for i in range(size)]


def test_the_first_rows_are_held_out_and_never_trained_on():
    train, val = split_rows(numbered, "src", "train", None, train_size=5, val_size=2)
    assert [r["i"] for r in val] == [0, 1] and [r["i"] for r in train] == [2, 3, 4, 5, 6]


def test_a_held_out_split_gives_its_first_rows():
    train, val = split_rows(lambda split, size: numbered(split, size + 3), "src", "train", "test", 5, 2)
    assert {r["split"] for r in train} == {"train"} and len(train) == 8
    assert [(r["split"], r["i"]) for r in val] == [("test", 0), ("test", 1)]


def test_too_few_rows_to_hold_out_and_train_is_named():
    with pytest.raises(
        ValueError,
        match=r"data.source='f.jsonl' has 3 rows, not enough to hold out "
        r"data.val_size=3 for validation and still train.",
    ):
        split_rows(lambda split, size: numbered(split, 3), "f.jsonl", "train", None, 10, 3)


def test_every_data_module_holds_out_the_same_rows_of_a_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": f"What is {i} + 1?",
                    "answer": str(i + 1),
                    "completion": f"{i + 1}",
                    "chosen": f"{i + 1}",
                    "rejected": f"{i + 2}",
                }
            )
            + "\n"
            for i in range(10)
        )
    )
    modules = [
        SFTDataModule(source=str(path), val_size=3),
        PreferenceDataModule(source=str(path), val_size=3),
        OnPolicyDataModule(source=SourceSpec(str(path)), held_out=HeldOutSpec(size=3)),
    ]
    for module in modules:
        module.setup()
        assert [r["answer"] for r in module.val_rows] == ["1", "2", "3"]
        assert [r["answer"] for r in module.train_rows] == [str(i + 1) for i in range(3, 10)]
    with pytest.raises(ValueError, match="has 10 rows, not enough to hold out data.val_size=10"):
        SFTDataModule(source=str(path), val_size=10).setup()
