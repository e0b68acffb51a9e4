"""Strategies lit_grpo cannot train under are refused at setup, in one line that says what to use.

Lightning itself refuses ``FSDPStrategy`` on a CPU when the Trainer is built
("The strategy `fsdp` requires a GPU accelerator, but received
`accelerator='cpu'`..."), and ``DeepSpeedStrategy`` when deepspeed is not
installed, so here the refused strategies sit on a stand-in for the Trainer;
``tests/test_gpu.py`` runs the refusal through a real GPU Trainer.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

from lit_grpo.training.strategies import check_strategy

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def refused_strategies():
    # DeepSpeedStrategy.__init__ refuses to run without deepspeed installed; an
    # instance made without it is still the real class, which is all the check reads.
    yield FSDPStrategy()
    yield DeepSpeedStrategy.__new__(DeepSpeedStrategy)


@pytest.mark.parametrize("strategy", refused_strategies(), ids=["fsdp", "deepspeed"])
def test_fsdp1_and_deepspeed_are_refused_in_one_line_naming_the_fsdp2_route(strategy):
    with pytest.raises(ValueError) as error:
        check_strategy(SimpleNamespace(strategy=strategy))
    message = str(error.value)
    assert message.startswith(f"trainer.strategy={type(strategy).__name__} is not supported: ")
    assert "\n" not in message
    assert "lightning.pytorch.strategies.ModelParallelStrategy" in message and "configs/fsdp.yaml" in message


def test_the_config_the_refusal_points_to_uses_model_parallel_strategy():
    assert "class_path: lightning.pytorch.strategies.ModelParallelStrategy" in (CONFIGS / "fsdp.yaml").read_text()


@pytest.mark.parametrize("strategy", ["auto", "ddp", ModelParallelStrategy()], ids=["auto", "ddp", "fsdp2"])
def test_single_device_ddp_and_fsdp2_trainers_pass(strategy):
    check_strategy(L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False))
