"""Randomly initialised models of real shapes, with a tokenizer built in code.

Speed and memory depend on a model's shapes, not on its weights, so a model
built from the configuration of a real one (random weights, nothing
downloaded) measures both where no weights can be fetched, e.g. a GPU machine
without a model hub. What such a model writes is not worth learning from:
sample it to the full completion length (``SamplingSpec(ignore_eos=True)``).

:func:`byte_tokenizer` needs no files either: a byte-level tokenizer (the 256
byte symbols, then the special tokens) with a ChatML chat template. Its ids
fit any vocabulary; decoding skips the ids it does not know, which a random
model samples too. :func:`save_random_model` writes a model folder (config,
random weights, tokenizer) that ``PolicySpec(name_or_path=folder)`` loads like
any other.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# For tests and dry runs; bitsandbytes' CPU 4-bit kernels need 64 | inputs and 32 | outputs.
_TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)

SHAPES: dict[str, tuple[str, dict]] = {
    "tiny": ("llama", _TINY),
    "tiny-qwen2": ("qwen2", _TINY),  # the same in Qwen2's layout: biased q/k/v projections
    "smollm2-135m": (
        "llama",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-1.5b": (
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-3b": (
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-7b": (
        "qwen2",
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
}
"""Name -> (``model_type``, configuration): the shapes of SmolLM2-135M and Qwen2.5-1.5B, 3B and 7B."""

PAD, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    """A byte-level tokenizer with a ChatML template, built without any file (259 ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())  # one printable symbol per byte
    vocab = {symbol: i for i, symbol in enumerate([*symbols, PAD, BOS, EOS])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


def parameter_count(shape: str) -> int:
    """Parameters of a model of ``shape``, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = _build(shape, byte_tokenizer(), torch.float32)
    return sum(p.numel() for p in model.parameters())


def save_random_model(
    shape: str,
    folder: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> Path:
    """Write a randomly initialised model of ``shape`` and :func:`byte_tokenizer` to ``folder``.

    Args:
        shape: A key of :data:`SHAPES`.
        folder: Where the model folder goes; an existing one is kept as it is.
        dtype: Dtype of the saved weights.
        device: Where the weights are initialised (``"cuda"`` is much faster
            for billions of parameters).
        seed: Seed of the initialisation.

    Returns:
        The folder.
    """
    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    tokenizer = byte_tokenizer()
    torch.manual_seed(seed)
    with torch.device(device):
        model = _build(shape, tokenizer, dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(folder)  # atomic: an interrupted write never leaves half a folder
    return folder


def _build(shape: str, tokenizer, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, sizes = SHAPES[shape]
    config = AutoConfig.for_model(
        model_type,
        **sizes,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return AutoModelForCausalLM.from_config(config, dtype=dtype)
