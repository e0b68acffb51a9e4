"""The bad-input catalogue: every mistake fails early, naming the field, the value
and what was expected (none surfaces as a traceback from inside torch/transformers).

Each test triggers one mistake at the earliest point it can be caught (a
constructor, ``DataModule.setup`` or the CLI parser) and checks the message.
"""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch

from lit_grpo.data import OnPolicyDataModule
from lit_grpo.module import GRPOModule
from lit_grpo.policy import PolicySpec, load_tokenizer
from lit_grpo.rewards import Accuracy, RewardCombiner, RewardFunctionError
from lit_grpo.rollout import SamplingSpec


@pytest.fixture(scope="module")
def module(tiny_model_dir):
    return GRPOModule(policy=PolicySpec(name_or_path=tiny_model_dir), progress=False)


def data(**overrides) -> OnPolicyDataModule:
    settings = dict(train_size=40, val_size=4, prompts_per_epoch=2, batch_size=4,
                    sampling=SamplingSpec(group_size=4, max_new_tokens=4), rewards=[Accuracy()])
    return OnPolicyDataModule(**{**settings, **overrides})


def set_up(datamodule: OnPolicyDataModule, module=None) -> None:
    """``setup("fit")`` as the Trainer runs it: with the module (and its tokenizer) attached."""
    if module is not None:
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.strategy.connect(module)
        datamodule.trainer = trainer
    datamodule.setup("fit")


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# --------------------------------------------------------------------- data
def test_missing_prompt_column(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1?", "answer": "2"}] * 10)
    with pytest.raises(ValueError, match=r"data.source=.*has no 'prompt' column; map one with data.columns"):
        set_up(data(source=source, val_size=2))


def test_missing_answer_column_for_accuracy(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1?"}] * 10)
    with pytest.raises(ValueError, match=r"Reward 'accuracy' needs the dataset column\(s\) \['answer'\].*data.source"):
        set_up(data(source=source, val_size=2))


def test_column_map_names_a_missing_column(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1?", "answer": "2"}] * 10)
    with pytest.raises(ValueError, match=r"data.columns maps 'prompt' to column 'query'.*available columns"):
        set_up(data(source=source, val_size=2, columns={"prompt": "query"}))


def test_empty_dataset_file(tmp_path):
    (tmp_path / "d.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"data.source=.*d.jsonl' is an empty file; expected a non-empty"):
        set_up(data(source=str(tmp_path / "d.jsonl")))


def test_dataset_without_rows(tmp_path):
    (tmp_path / "d.json").write_text("[]")
    with pytest.raises(ValueError, match=r"data.source=.*(has no rows|could not be read)"):
        set_up(data(source=str(tmp_path / "d.json")))


def test_dataset_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.source=.*missing.jsonl': no such file"):
        set_up(data(source=str(tmp_path / "missing.jsonl")))


def test_dataset_file_unreadable(tmp_path):
    (tmp_path / "d.parquet").write_text("not a parquet file")
    with pytest.raises(ValueError, match=r"data.source=.*d.parquet' could not be read as parquet"):
        set_up(data(source=str(tmp_path / "d.parquet")))


def test_dataset_file_of_unknown_type(tmp_path):
    (tmp_path / "d.txt").write_text("1+1?\n")
    with pytest.raises(ValueError, match=r"data.source=.*unknown file type '.txt'; expected one of"):
        set_up(data(source=str(tmp_path / "d.txt")))


def test_prompt_longer_than_max_prompt_length_is_refused(module):
    with pytest.raises(ValueError, match=r"tokens > data.max_prompt_length=8; raise the limit or set "
                                         r"data.prompt_overflow='truncate'"):
        set_up(data(max_prompt_length=8), module)


def test_prompt_longer_than_max_prompt_length_is_truncated_with_a_warning(module):
    with pytest.warns(UserWarning, match=r"longer than max_prompt_length=8 tokens were truncated"):
        set_up(data(max_prompt_length=8, prompt_overflow="truncate"), module)


def test_group_size_below_two():
    with pytest.raises(ValueError, match=r"sampling.group_size=1; expected >= 2"):
        SamplingSpec(group_size=1)


def test_batch_size_that_splits_a_group():
    with pytest.raises(ValueError, match=r"data.batch_size=3 does not divide the 8 completions.*divisor of 8"):
        set_up(data(batch_size=3))


def test_prompts_per_epoch_beyond_the_dataset_without_repeat():
    with pytest.raises(ValueError, match=r"data.prompts_per_epoch=41 exceeds the 40 training prompts; "
                                         r"set data.repeat=true"):
        set_up(data(prompts_per_epoch=41, repeat=False))


def test_tokenizer_without_chat_template(module):
    template, module.tokenizer.chat_template = module.tokenizer.chat_template, None
    try:
        with pytest.raises(ValueError, match=r"the tokenizer has no chat template"):
            set_up(data(), module)
    finally:
        module.tokenizer.chat_template = template


# ------------------------------------------------------------------ rewards
def score(reward):
    RewardCombiner([reward]).score(["p", "p"], ["a", "b"], {"answer": ["1", "2"]})


def test_reward_that_raises():
    def crashes(prompts, completions, **columns):
        raise KeyError("tests")

    with pytest.raises(RewardFunctionError, match=r"Reward 'crashes' raised on row 0: KeyError\('tests'\)"):
        score(crashes)


def test_reward_of_the_wrong_length():
    with pytest.raises(ValueError, match=r"Reward 'short' returned 1 values for 2 completions"):
        score(_named("short", [1.0]))


def test_reward_that_returns_a_string():
    with pytest.raises(ValueError, match=r"Reward 'text' returned '1' \(str\) on row 0; expected a number or None"):
        score(_named("text", ["1", "0"]))


def test_reward_that_returns_nan():
    with pytest.raises(ValueError, match=r"Reward 'nan' returned nan on row 1; values must be finite"):
        score(_named("nan", [1.0, math.nan]))


def _named(name: str, values):
    def reward(prompts, completions, **columns):
        return values

    reward.__name__ = name
    return reward


def test_all_completions_empty():
    from lit_grpo.rollout_round import _Group, _warn_if_all_empty

    empty = torch.zeros(2, 1)
    group = _Group(empty, empty, empty, empty, empty.bool()[:, 0], empty[:, 0], {}, "p", ["", " "])
    with pytest.warns(RuntimeWarning, match=r"epoch 3: all 4 completions are empty.*Expected some text"):
        _warn_if_all_empty([group, group], epoch=3)


# ---------------------------------------------------------- model, sampling
def test_model_folder_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"policy.name_or_path=.*nowhere': no such folder"):
        load_tokenizer(PolicySpec(name_or_path=str(tmp_path / "nowhere")))


def test_gguf_file_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"policy.name_or_path=.*model.gguf': no such GGUF file"):
        load_tokenizer(PolicySpec(name_or_path=str(tmp_path / "model.gguf")))


def test_gguf_file_missing_in_folder(tiny_model_dir):
    with pytest.raises(FileNotFoundError, match=r"policy.gguf_file='absent.gguf' is not in"):
        load_tokenizer(PolicySpec(name_or_path=tiny_model_dir, gguf_file="absent.gguf"))


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_temperature_not_positive(temperature):
    with pytest.raises(ValueError, match=rf"sampling.temperature={temperature}; expected > 0"):
        SamplingSpec(temperature=temperature)


@pytest.mark.parametrize("top_p", [0.0, 1.5])
def test_top_p_outside_unit_interval(top_p):
    with pytest.raises(ValueError, match=rf"sampling.top_p={top_p}; expected a value in \(0, 1\]"):
        SamplingSpec(top_p=top_p)


def test_unknown_loss_type(tiny_model_dir):
    with pytest.raises(ValueError, match=r"model.loss_type='ppo'; expected one of \['bnpo', 'dapo'"):
        GRPOModule(policy=PolicySpec(name_or_path=tiny_model_dir), loss_type="ppo")


def test_unknown_generation_dtype(tiny_model_dir):
    with pytest.raises(ValueError, match=r"model.generation_dtype='int8'; expected one of \['bfloat16'"):
        GRPOModule(policy=PolicySpec(name_or_path=tiny_model_dir), generation_dtype="int8")


def test_generation_dtype_without_the_merged_copy(tiny_model_dir):
    with pytest.raises(ValueError, match=r"model.generation_dtype='bfloat16' needs model.merge_for_generation=true"):
        GRPOModule(policy=PolicySpec(name_or_path=tiny_model_dir), generation_dtype="bfloat16",
                   merge_for_generation=False)


# ---------------------------------------------------------------------- CLI
@pytest.mark.parametrize(("argument", "message"), [
    ("--data.promts_per_epoch=2", "unrecognized arguments: --data.promts_per_epoch=2"),
    ("--model.loss_type=ppo", "Expected a typing.Literal['grpo', 'bnpo', 'dapo', 'dr_grpo']. Got value: ppo"),
])
def test_cli_rejects_bad_keys_and_values(capsys, argument, message):
    from lit_grpo.cli import main

    with pytest.raises(SystemExit):
        main(["fit", argument])
    assert message in capsys.readouterr().err
