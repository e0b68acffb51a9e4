"""Shared fixtures: a tiny randomly initialised Llama saved as a real model folder.

The tiny model uses the embedded SmolLM2 tokenizer (real chat template, real
EOS handling) with a few-layer, 32-wide transformer, so end-to-end runs take
seconds while still exercising the real loading path (``from_pretrained``).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items) -> None:
    """Skip tests marked ``gpu`` where no CUDA device is (``scripts/gpu_check.sh`` runs them where one is)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def build_tiny_model(tokenizer, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="session")
def embedded_dir() -> str:
    from lit_grpo.model.sources import embedded_model_dir

    return str(embedded_model_dir())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_dir) -> str:
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    model = build_tiny_model(tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
