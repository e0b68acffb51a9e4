"""The pieces that keep multi-process runs from hanging, on one process.

The same pieces run on 2 processes in tests/test_cli_multiprocess.py.
"""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from lit_grpo.training.distributed import reduce_across_ranks
from lit_grpo.training.multiprocess import (
    CPU_TIMEOUT_S,
    describe_collective_failure,
    is_collective_failure,
    set_collective_timeout,
)


def test_reduce_across_ranks_on_one_process():
    strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    means, total = reduce_across_ranks(strategy, {"a": 2.0, "b": torch.tensor(-1.0)}, weight=3)
    assert means == {"a": 2.0, "b": -1.0} and total == 3
    # A rank with nothing to report passes weight 0; with no weight anywhere the means are NaN.
    means, total = reduce_across_ranks(strategy, {"a": 5.0}, weight=0)
    assert total == 0 and math.isnan(means["a"])
    assert reduce_across_ranks(strategy, {"m": 7.0}, op="max") == ({"m": 7.0}, 1.0)


@pytest.mark.parametrize("strategy_class", [DDPStrategy, ModelParallelStrategy])
def test_collective_timeout_defaults_and_overrides(strategy_class):
    strategy = strategy_class()
    strategy.accelerator = None
    strategy.parallel_devices = [torch.device("cpu")]
    assert set_collective_timeout(strategy, None) == CPU_TIMEOUT_S  # Lightning's 30 min replaced
    assert strategy._timeout == timedelta(seconds=CPU_TIMEOUT_S)
    assert set_collective_timeout(strategy, 42) == 42 and strategy._timeout == timedelta(seconds=42)
    # A timeout the user gave the strategy itself is kept.
    own = strategy_class(timeout=timedelta(seconds=90))
    assert set_collective_timeout(own, None) == 90 and own._timeout == timedelta(seconds=90)
    with pytest.raises(ValueError, match=r"collective_timeout=0; expected a positive number"):
        set_collective_timeout(strategy, 0)


def test_no_timeout_on_one_process():
    assert set_collective_timeout(SingleDeviceStrategy(device=torch.device("cpu")), None) is None


def _hook_that_waits():
    raise torch.distributed.DistBackendError("[gloo] Timed out waiting 15000ms for recv operation to complete")


def test_a_failed_collective_is_described_with_its_hook():
    def _call_callback_hooks(trainer, hook_name, callback):  # the shape of Lightning's call.py frame
        _hook_that_waits()

    _call_callback_hooks.__code__ = _call_callback_hooks.__code__.replace(co_filename="lightning/trainer/call.py")

    class RichProgressBar:
        pass

    with pytest.raises(RuntimeError) as caught:
        _call_callback_hooks(None, "on_train_epoch_end", RichProgressBar())
    assert is_collective_failure(caught.value)
    line = describe_collective_failure(caught.value, rank=1)
    assert line.startswith("rank 1: a collective failed in RichProgressBar.on_train_epoch_end ")
    assert "test_multiprocess.py" in line and "_hook_that_waits" in line and "Timed out waiting 15000ms" in line
    assert not is_collective_failure(ValueError("data.batch_size=0; expected >= 1."))
