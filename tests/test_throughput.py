"""perf/* metrics: the FLOP count against torch's own counter, the probe, the dtype ``auto`` picks."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from test_module import make, trainer
from torch.utils.flop_counter import FlopCounterMode

from lit_grpo.model import hardware
from lit_grpo.model.policy import PolicySpec, build_policy
from lit_grpo.training.throughput import EpochThroughput, FlopModel, completion_pairs, rollout_tokens


def _tiny_policy(tiny_model_dir, lora=True):
    from lit_grpo.model.policy import LoraSpec

    spec = PolicySpec(name_or_path=tiny_model_dir, lora=LoraSpec(r=4, alpha=8) if lora else None)
    return build_policy(spec, need_reference=False)[0]


def test_the_linear_flops_are_what_torch_counts_in_a_forward(tiny_model_dir):
    policy = _tiny_policy(tiny_model_dir)
    costs = FlopModel.of(policy)
    ids = torch.randint(0, 100, (3, 7))
    with FlopCounterMode(display=False) as counter:
        with torch.no_grad():
            policy(input_ids=ids)
    counts = counter.get_flop_counts()["Global"]
    matmuls = sum(v for op, v in counts.items() if str(op).split(".")[1] in ("mm", "addmm", "bmm"))
    assert matmuls == 2 * (costs.base_linear + costs.adapter_linear) * ids.numel()


def test_lora_trains_the_adapter_only_and_full_fine_tuning_every_layer(tiny_model_dir):
    lora, full = FlopModel.of(_tiny_policy(tiny_model_dir)), FlopModel.of(_tiny_policy(tiny_model_dir, lora=False))
    assert lora.trained_linear == lora.adapter_linear > 0
    assert full.adapter_linear == 0 and full.trained_linear == full.base_linear == lora.base_linear
    assert lora.attention == full.attention == 2 * 4 * 8  # layers x heads x head_dim
    # a training pass under LoRA: forward + input gradients + the adapter's weight gradients
    tokens, pairs = 10.0, 30.0
    expected = 2 * (2 * lora.base_linear + 3 * lora.adapter_linear) * tokens + 12 * lora.attention * pairs
    assert lora.forward_backward(tokens, pairs) == expected


def test_rows_that_share_a_prompt_count_it_once():
    prompt_ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6]])
    prompt_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1]])
    attention = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    tokens, pairs = rollout_tokens(prompt_ids, prompt_mask, attention)
    assert tokens == (2 + 3) + (2 + 1 + 3 + 0)
    # each prompt's causal pairs once, then each completion token attends to its prompt and itself before
    assert pairs == (3 + 6) + (2 * 2 + 3) + (1 * 2 + 1) + (3 * 3 + 6)


def test_the_epoch_metrics_divide_flops_by_the_phases_that_did_them():
    costs = FlopModel(base_linear=100, adapter_linear=0, trained_linear=0, attention=0)
    meter = EpochThroughput(costs, peak=1e4)
    rows = {
        "prompt_ids": torch.zeros(2, 1, dtype=torch.long),
        "prompt_mask": torch.ones(2, 1),
        "completion_mask": torch.ones(2, 4),
        "ref_logprobs": torch.zeros(2, 4),
    }
    tokens, pairs = rollout_tokens(rows["prompt_ids"], rows["prompt_mask"], rows["completion_mask"])
    # twice the 8 kept tokens generated: dynamic sampling dropped a round
    meter.rollout(
        {
            "tokens": tokens,
            "pairs": pairs,
            "decode_pairs": 0.0,
            "decode_steps": 0.0,
            "generated": 16,
            "kept": 8,
            "reference": 1,
            "old": 0,
        }
    )
    meter.step(rows)
    perf = meter.metrics(
        {"generate": 2.0, "reward": 1.0, "reference": 0.5, "policy_forward": 0.5, "policy_backward": 1.0}
    )
    forward = 2 * 100 * 9  # 1 shared prompt token + 8 completion tokens
    assert perf["perf/mfu"] == pytest.approx((forward + 2 * forward) / 2.0 / 1e4)
    assert perf["perf/rollout_mfu"] == pytest.approx(2 * forward / 2.0 / 1e4)
    assert perf["perf/tokens_per_s"] == pytest.approx(8 / 5.0)


def test_a_fit_logs_throughput_and_mfu_below_the_measured_peak(tmp_path, tiny_model_dir):
    module, data = make(tiny_model_dir)
    fit = trainer(tmp_path, epochs=1)
    fit.fit(module, data)
    metrics = fit.callback_metrics
    assert metrics["perf/tokens_per_s"] > 0
    assert 0 < metrics["perf/mfu"] < 1 and 0 < metrics["perf/rollout_mfu"] < 1
    assert metrics["perf/rollout_roofline"] >= metrics["perf/rollout_mfu"]  # the FLOPs bound is one of two


def test_a_decode_reads_every_weight_per_step_and_the_cache_per_pair(tiny_model_dir):
    policy = _tiny_policy(tiny_model_dir)
    costs = FlopModel.of(policy)
    linear = [m for m in policy.modules() if isinstance(m, torch.nn.Linear)]
    assert costs.weight_bytes == sum(m.weight.numel() * 4 for m in linear)
    config = policy.config
    assert costs.kv_bytes == 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert costs.decode_bytes(steps=3, pairs=10) == 3 * costs.weight_bytes + 10 * costs.kv_bytes
    # a prompt of 2 tokens, a completion of 3: each completion token reads 2 prompt entries and 1, 2, 3 of its own
    assert completion_pairs(torch.tensor([[0, 1, 1]]), torch.tensor([[1, 1, 1, 0]])) == 3 * 2 + 6


@pytest.mark.parametrize("linear, bound", [(1, "bytes"), (1000, "flops")])
def test_the_roofline_is_the_larger_of_bytes_over_bandwidth_and_flops_over_peak(linear, bound):
    costs = FlopModel(
        base_linear=linear, adapter_linear=0, trained_linear=0, attention=0, weight_bytes=1000, kv_bytes=10
    )
    meter = EpochThroughput(costs, peak=1e4, bandwidth=1e4)
    counts = {"tokens": 6, "pairs": 0, "decode_pairs": 50.0, "decode_steps": 4.0, "generated": 8, "kept": 4}
    meter.rollout({**counts, "reference": 0, "old": 0})
    # dynamic sampling sampled twice the kept tokens: their FLOPs and cache reads count twice, the steps as they ran
    seconds = {"bytes": (4 * 1000 + 100 * 10) / 1e4, "flops": 2 * 2 * linear * 6 / 1e4}[bound]
    assert meter.metrics({"generate": 2.0})["perf/rollout_roofline"] == pytest.approx(seconds / 2)
    assert "perf/rollout_roofline" not in EpochThroughput(costs, peak=1e4).metrics({"generate": 2.0})
    # logged by every rank alike (it is reduced): also by one that generated nothing
    assert EpochThroughput(costs, peak=1e4, bandwidth=1e4).metrics({})["perf/rollout_roofline"] == 0.0


def test_the_bandwidth_probe_measures_and_caches(tmp_path):
    bandwidth = hardware.peak_bandwidth("cpu", str(tmp_path))
    assert bandwidth > 1e8
    (stored,) = json.loads((tmp_path / "matmul_peak.json").read_text()).values()
    assert stored == {"bytes_per_s": bandwidth}


def _cached(tmp_path, fp32: float, bf16: float) -> str:
    key = f"{hardware.cpu_name()} | {torch.get_num_threads()} threads | torch {torch.__version__}"
    (tmp_path / "matmul_peak.json").write_text(json.dumps({key: {"float32": fp32, "bfloat16": bf16}}))
    return str(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto looks at the GPU where there is one")
@pytest.mark.parametrize("bf16, expected", [(4e11, torch.bfloat16), (1.4e11, torch.float32)])
def test_auto_trains_in_bf16_only_where_its_matmuls_are_measured_faster(tmp_path, bf16, expected):
    cache = _cached(tmp_path, fp32=1e11, bf16=bf16)
    assert PolicySpec(dtype="auto", cache_dir=cache).torch_dtype == expected
    assert hardware.peak_flops("cpu", cache) == max(1e11, bf16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is about CPUs")
def test_asking_for_bf16_where_the_cpu_emulates_it_warns_with_both_rates(tmp_path):
    slow = _cached(tmp_path, fp32=1e11, bf16=3e9)
    with pytest.warns(UserWarning, match=r"bf16 matmuls measure 3 GFLOP/s against 100 in fp32.*auto picks float32"):
        assert PolicySpec(dtype="bfloat16", cache_dir=slow).torch_dtype == torch.bfloat16
    (tmp_path / "fast").mkdir()
    fast = _cached(tmp_path / "fast", fp32=1e11, bf16=4e11)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert PolicySpec(dtype="bfloat16", cache_dir=fast).torch_dtype == torch.bfloat16


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads /proc/cpuinfo")
def test_the_cpu_name_tells_apart_cpus_sold_under_one_name():
    # the probe's cache is keyed by it: a Zen 3 and a Zen 5 are both "AMD EPYC" in a VM
    assert re.search(r" \(family \d+, model \d+, (no bf16 units|amx_bf16|avx512_bf16)", hardware.cpu_name())


def test_the_probe_measures_and_caches_both_dtypes(tmp_path):
    flops = hardware.cpu_matmul_flops(str(tmp_path))
    assert set(flops) == {"float32", "bfloat16"} and min(flops.values()) > 1e8
    stored = json.loads((tmp_path / "matmul_peak.json").read_text())
    assert list(stored.values()) == [flops]
    with pytest.raises(ValueError, match=r"policy.dtype='fp8'; expected one of \['bfloat16', 'float16'"):
        PolicySpec(dtype="fp8")
