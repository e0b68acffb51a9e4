"""Lightning's precision settings around GRPOModule on a CPU: a plain Trainer trains and validates."""

from __future__ import annotations

import pytest
import torch

from test_module import make, trainer


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_plain_trainer_trains_and_validates_at_bf16(tmp_path, tiny_model_dir, precision):
    # bf16-mixed used to die in the first greedy validation: the lean decode step's fp32 packed
    # weights got bf16 activations under autocast.
    module, data = make(tiny_model_dir)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if "lora_" in n}
    fit = trainer(tmp_path, epochs=2, precision=precision, check_val_every_n_epoch=1)
    fit.fit(module, data)
    metrics = fit.callback_metrics
    for key in ("train/loss", "val/accuracy", "train/kl"):
        assert key in metrics and torch.isfinite(metrics[key]), key
    after = dict(module.policy.named_parameters())
    assert any(not torch.equal(before[n].to(after[n].dtype), after[n]) for n in before)  # it trained
    expected = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert all(after[n].dtype == expected for n in before)
