"""Bad values that a library refuses, a conversational data file, a small task: through the real CLI.

A value that torch, peft or transformers refuses ends the run in one line naming the
config field that carried it (``lit-grpo: model.optimizer.init_args.lr=-1.0: torch
refuses it: ...``, exit code 2), before anything trains, instead of as an
"unexpected" error with a traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from test_bad_inputs import fit  # noqa: F401  (the fixture: lit-grpo fit on the tiny model, in-process)

from lit_grpo.cli_checks import check_moved_keys


def test_optimizer_value_torch_refuses(fit):  # noqa: F811
    code, last = fit("--model.optimizer=torch.optim.AdamW", "--model.optimizer.init_args.lr=-1.0")
    assert code == 2
    assert last == "lit-grpo: model.optimizer.init_args.lr=-1.0: torch refuses it: Invalid learning rate: -1.0"


def test_scheduler_value_torch_refuses(fit):  # noqa: F811
    # torch's message quotes no value: every configured value is shown
    code, last = fit(
        "--model.scheduler=torch.optim.lr_scheduler.LinearLR", "--model.scheduler.init_args.start_factor=2"
    )
    assert code == 2
    assert last.startswith("lit-grpo: model.scheduler.init_args={start_factor: 2.0, ")
    assert "torch refuses it: Starting multiplicative factor expected to be greater than 0" in last


def test_lora_target_modules_peft_refuses(fit):  # noqa: F811
    code, last = fit("--model.policy.lora.target_modules=[attention]")
    assert code == 2
    assert last.startswith("lit-grpo: policy.lora.target_modules=['attention']: peft refuses it: Target modules")


def test_folder_that_is_not_a_model_names_what_is_missing(fit, tmp_path, tiny_model_dir):  # noqa: F811
    (tmp_path / "notes").mkdir()
    code, last = fit(f"--model.policy.name_or_path={tmp_path / 'notes'}")
    assert code == 2
    assert last.startswith(
        f"lit-grpo: policy.name_or_path='{tmp_path / 'notes'}' is not a model folder: it has "
        "no config.json and no weights"
    )
    weights_only = tmp_path / "weights_only"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        (weights_only / name).write_bytes((Path(tiny_model_dir) / name).read_bytes())
    code, last = fit(f"--model.policy.name_or_path={weights_only}")
    assert code == 2
    assert "is not a model folder: it has no tokenizer files" in last


def test_damaged_tokenizer_transformers_refuses(fit, tmp_path, tiny_model_dir):  # noqa: F811
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "tokenizer.json").write_text("{not json")
    code, last = fit(f"--model.policy.name_or_path={broken}")
    assert code == 2
    assert last.startswith(f"lit-grpo: policy.name_or_path='{broken}': ") and "refuses it: " in last


def test_task_with_fewer_questions_than_train_size_names_it(fit):  # noqa: F811
    # 1-digit sums: 10 x 10 = 100 distinct questions, 120 asked
    code, last = fit("--data.source.train_size=118", '--data.source.task_args={"digits": 1, "ops": "+"}')
    assert code == 2
    assert last.startswith(
        "lit-grpo: data.source.train_size=118 + data.held_out.size=2 rows asked of data.source.dataset='arithmetic': "
    )
    assert "it has 100 distinct ones" in last and "Lower data.source.train_size" in last
    code, _ = fit(
        "--data.source.train_size=90", '--data.source.task_args={"digits": 1, "ops": "+"}', "--data.held_out.slices={}"
    )
    assert code == 0


def test_conversational_prompts_train_through_the_cli(fit, tmp_path):  # noqa: F811
    # TRL's conversational format: the prompt column holds message lists (crashed at setup:
    # "unhashable type: 'list'" from the held-out slices' set of taken prompts).
    rows = [
        {
            "prompt": [
                {"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": f"What is {i} + {i}?"},
            ],
            "answer": str(2 * i),
        }
        for i in range(12)
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    code, last = fit(
        f"--data.source.dataset={data}", "--data.source.train_size=10", f"--export_adapter={tmp_path / 'adapter'}"
    )
    assert code == 0, last
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_strategy_class_name_as_a_string_names_the_class_path_form(fit):  # noqa: F811
    # Lightning would read the string as a registered name and fail with "invalid strategy name".
    code, last = fit("--trainer.strategy=ModelParallelStrategy")
    assert code == 2
    assert last == (
        "lit-grpo: trainer.strategy='ModelParallelStrategy' is a class name, and Lightning reads a "
        "string as a registered strategy name (ddp, fsdp, ...); pass the class: "
        "--trainer.strategy.class_path ModelParallelStrategy (in YAML: strategy: "
        "{class_path: ModelParallelStrategy})."
    )


def test_a_data_key_of_the_old_flat_layout_names_its_group(fit, tmp_path):  # noqa: F811
    code, last = fit("--data.val_size=4")
    assert code == 2
    assert last == (
        "lit-grpo: data.val_size is now data.held_out.size (the held-out settings are one group, "
        "data.held_out); move it there."
    )
    code, last = fit("--data.max_prompt_length", "64")
    assert code == 2 and last.startswith("lit-grpo: data.max_prompt_length is now data.prompt.max_length ")
    config = tmp_path / "old.yaml"
    config.write_text("data:\n  source: countdown\n  advantage_estimator: rloo\n")
    code, last = fit(f"--config={config}")
    assert code == 2
    assert last == (
        "lit-grpo: data.source='countdown': data.source is now a group (the dataset, its split, columns and "
        "task options); write data.source.dataset='countdown'."
    )
    config.write_text("data:\n  source: {dataset: countdown}\n  advantage_estimator: rloo\n")
    code, last = fit(f"--config={config}")
    assert code == 2 and last.startswith("lit-grpo: data.advantage_estimator is now data.advantage.estimator ")


def test_a_group_given_whole_or_null_is_not_taken_for_the_old_layout():
    for argv in (["--data.source", '{"dataset": "countdown"}'], ["--data.source=null"], ["--data.source.dataset=x"]):
        check_moved_keys(argv)  # nothing refused


def test_an_episode_key_of_the_old_flat_layout_names_its_new_place(fit, tmp_path):  # noqa: F811
    code, last = fit('--data.tools=["lit_grpo.environments.builtin.calculator"]')
    assert code == 2
    assert last == (
        "lit-grpo: data.tools is now data.episodes.tools (the episode settings are one group, "
        "data.episodes); move it there."
    )
    config = tmp_path / "old.yaml"
    config.write_text("data:\n  max_turns: 2\n  environment:\n    class_path: x.Y\n")
    code, last = fit(f"--config={config}")
    assert code == 2 and last.startswith("lit-grpo: data.max_turns is now data.episodes.max_turns ")
    code, last = fit("--data.environment.init_args.max_guesses=3")
    assert code == 2 and "is now data.episodes.environment.init_args.max_guesses " in last
