"""``scripts/gpu_check.sh`` cannot rot: its dry run (the GPU check's stages on a CPU, on a tiny shape) runs
here, and the random models it measures on a GPU have the shapes they are named after."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from lit_grpo.model.random_models import SHAPES, byte_tokenizer, parameter_count

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_writes_the_report_with_every_step_measured(tmp_path):
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "OUT": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = (tmp_path / "gpu_check.md").read_text()
    # The dry run hides CUDA, so every gpu test is collected and skipped, none fails to import.
    assert re.search(r"`pytest -m gpu tests/test_gpu.py`: \d+ skipped in ", report), report
    assert "needs a CUDA GPU" in report
    rows = [line for line in report.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 4 and all(row.endswith("| ok |") for row in rows), report  # LoRA and QLoRA x 2 recipes


def test_the_smollm2_shape_is_the_embedded_models(embedded_dir):
    from transformers import AutoConfig

    embedded = json.loads((Path(embedded_dir) / "config.json").read_text())
    model_type, sizes = SHAPES["smollm2-135m"]
    ours = AutoConfig.for_model(model_type, **sizes).to_dict()
    for name in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rope_parameters",
        "tie_word_embeddings",
    ):
        assert ours[name] == embedded[name], name
    assert ours["rms_norm_eps"] == pytest.approx(embedded["rms_norm_eps"])  # the GGUF stores it in float32


@pytest.mark.parametrize("shape, published", [("qwen2.5-1.5b", "1.54"), ("qwen2.5-7b", "7.61")])
def test_the_qwen_shapes_have_the_published_parameter_counts(shape, published):
    assert f"{parameter_count(shape) // 10**7 / 100:.2f}" == published  # the model cards' billions, truncated


def test_byte_tokenizer_round_trips_chat_text_and_skips_ids_it_does_not_know():
    tokenizer = byte_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4? ünï"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.eos_token_id) == 1  # one id per special token
    assert tokenizer.decode(ids) == text and max(ids) < len(tokenizer) == 259
    assert tokenizer.decode([ids[1], 100_000]) == tokenizer.decode([ids[1]])  # a random model samples such ids
