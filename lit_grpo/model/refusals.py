"""A third-party constructor's refusal, reported against the config field that carried the value.

The config instantiates objects lit_grpo does not own (torch's optimizers and
schedulers, peft's LoRA layers, transformers' models and tokenizers). Their
checks raise plain ``ValueError``s deep inside the library, without the YAML
field the value came from; :func:`constructed` re-raises them from here,
naming the field, so ``lit-grpo`` reports them in one line
(``model.optimizer.init_args.lr=-1.0: torch refuses it: Invalid learning
rate: -1.0``) instead of as an unexpected error with a traceback.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

REFUSALS = (ValueError, TypeError, KeyError, OSError)
"""What a constructor raises when it refuses its arguments (its own bugs raise other things)."""


def constructed(field: str, build: Callable, *args, values: Mapping[str, Any] | None = None, **kwargs):
    """``build(*args, **kwargs)``; a refusal becomes a ``ValueError`` naming ``field``.

    Args:
        field: Where the config holds the object's arguments (``model.optimizer.init_args``).
        build: The constructor, or a ``functools.partial`` of it (what LightningCLI makes of a
            ``class_path`` with ``init_args``; its keywords are the values shown).
        values: The configured values, when ``build`` is not such a partial.

    Raises:
        ValueError: ``build`` refused; the message names the field (the one value the refusal
            quotes, or all of them), the library and its reason.
    """
    try:
        return build(*args, **kwargs)
    except REFUSALS as error:
        raise ValueError(refusal(field, build, error, values)) from error


def refusal(field: str, build: Callable, error: BaseException, values: Mapping[str, Any] | None = None) -> str:
    """The one-line message of :func:`constructed`."""
    # LightningCLI's partials call jsonargparse's instantiator with the configured class as an argument.
    target = next((a for a in reversed(getattr(build, "args", ())) if isinstance(a, type)), None)
    target = target or getattr(build, "func", build)
    values = dict(getattr(build, "keywords", None) or {}) if values is None else dict(values)
    library = (getattr(target, "__module__", None) or "the library").split(".")[0]
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)  # no repr quotes
    reason = " ".join(text.split()) or type(error).__name__
    quoted = [name for name, value in values.items() if _quotes(reason, value)] if len(values) > 1 else list(values)
    if len(quoted) == 1:
        where = f"{field}.{quoted[0]}={values[quoted[0]]!r}"
    elif values:
        where = f"{field}={{{', '.join(f'{name}: {value!r}' for name, value in values.items())}}}"
    else:
        where = field
    return f"{where}: {library} refuses it: {reason}"


def _quotes(reason: str, value: Any) -> bool:
    """Whether ``reason`` shows ``value`` as a word of its own (a list: any of its elements)."""
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, (list, tuple, set)):
        return any(_quotes(reason, item) for item in value)
    text = str(value)
    return bool(text) and re.search(rf"(?<![\w.-]){re.escape(text)}(?![\w.])", reason) is not None
