"""The public names import from the top of the package, and lazily."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

import lit_grpo


def test_public_classes_import_from_the_package():
    from lit_grpo import (  # noqa: F401
        DPOModule, GRPOModule, LoraSpec, OnPolicyDataModule, PolicySpec, PreferenceDataModule, SamplingSpec,
    )
    from lit_grpo.algorithms.grpo import GRPOModule as defined

    assert GRPOModule is defined
    assert set(lit_grpo.__all__) <= set(dir(lit_grpo))


def test_the_math_and_the_rewards_import_without_lightning_or_transformers():
    code = ("import sys, lit_grpo, lit_grpo.objectives, lit_grpo.rewards; "
            "print(sorted(m for m in ('lightning', 'transformers', 'peft') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_an_unknown_name_is_an_attribute_error():
    try:
        lit_grpo.GRPOModul  # noqa: B018
    except AttributeError as error:
        assert "GRPOModul" in str(error)
    else:
        raise AssertionError("expected an AttributeError")



# Each module of the flat layout -> where it lives now.
MOVED = {
    "lit_grpo.module": "lit_grpo.algorithms.grpo", "lit_grpo.policy_module": "lit_grpo.algorithms.base",
    "lit_grpo.dpo": "lit_grpo.algorithms.dpo", "lit_grpo.ppo": "lit_grpo.algorithms.ppo",
    "lit_grpo.dpo_data": "lit_grpo.data.preferences", "lit_grpo.rollout_round": "lit_grpo.data.rollout_round",
    "lit_grpo.buffer": "lit_grpo.data.buffer", "lit_grpo.sources": "lit_grpo.data.sources",
    "lit_grpo.tasks": "lit_grpo.data.tasks", "lit_grpo.word_problems": "lit_grpo.data.word_problems",
    "lit_grpo.rollout": "lit_grpo.generation.rollout", "lit_grpo.decode_step": "lit_grpo.generation.decode_step",
    "lit_grpo.merged": "lit_grpo.generation.merged", "lit_grpo.kv_cache": "lit_grpo.model.kv_cache",
}


def test_old_dotted_paths_import_the_moved_modules():
    code = "\n".join([
        "import importlib, pickle",
        f"for old, new in {MOVED!r}.items():",
        "    assert importlib.import_module(old) is importlib.import_module(new), old",
        "    assert importlib.import_module(old).__spec__.name == new, old",  # its own spec, not the alias's
        "import lit_grpo.module, lit_grpo.algorithms.grpo, lit_grpo.data.grpo",
        "assert lit_grpo.module.GRPOModule is lit_grpo.algorithms.grpo.GRPOModule",
        "from lit_grpo.data import OnPolicyDataModule, chat_prompts",  # lit_grpo.data was a module
        "assert OnPolicyDataModule is lit_grpo.data.grpo.OnPolicyDataModule",
        "assert chat_prompts is lit_grpo.data.prompts.chat_prompts",
        "from lit_grpo.rollout import SamplingSpec",
        "from lit_grpo.generation.rollout import SamplingSpec as moved",
        "assert SamplingSpec is moved",
        # A checkpoint pickled before the move names the old module.
        "old_pickle = pickle.dumps(moved(group_size=3), protocol=0)"
        ".replace(b'lit_grpo.generation.rollout', b'lit_grpo.rollout')",
        "assert b'lit_grpo.rollout\\n' in old_pickle and pickle.loads(old_pickle) == moved(group_size=3)",
    ])
    subprocess.run([sys.executable, "-c", code], check=True)  # a fresh process: none of them imported yet


def test_a_config_naming_the_old_class_paths_parses(tmp_path, monkeypatch):
    from lightning.pytorch import LightningDataModule

    from lit_grpo.algorithms.base import PolicyModule
    from lit_grpo.algorithms.grpo import GRPOModule
    from lit_grpo.cli import GRPOCli
    from lit_grpo.data.grpo import OnPolicyDataModule

    config = tmp_path / "old.yaml"
    config.write_text(yaml.safe_dump({
        "seed_everything": 0, "trainer": {"default_root_dir": str(tmp_path), "logger": False},
        "model": {"class_path": "lit_grpo.module.GRPOModule", "init_args": {"beta": 0.1}},
        "data": {"class_path": "lit_grpo.data.OnPolicyDataModule", "init_args": {"source": "arithmetic"}},
    }))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lit-grpo"])
    # A user's own CLI, whose YAML chooses the classes; run=False builds them without training.
    cli = GRPOCli(PolicyModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                  args=["--config", str(config)], run=False)
    assert type(cli.model) is GRPOModule and cli.model.hparams.beta == 0.1
    assert type(cli.datamodule) is OnPolicyDataModule
