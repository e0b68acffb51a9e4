"""Handing our KV cache to a transformers model, under the name its version reads.

The decode loop and the log-prob passes build a ``DynamicCache`` themselves
and pass it to ``model(...)``. transformers 5.24 renamed that forward argument
from ``past_key_values`` to ``cache`` (the old name warns until 5.40). Before
5.24 a ``cache=`` keyword lands in the model's ``**kwargs`` without an error:
the model fills a cache of its own, ours stays empty, and every later pass
would run without the prompt. lit_grpo supports transformers >= 5.17 (what
the GPU image carries), so the name is chosen once, from the installed
version. This module can go when the minimum transformers is 5.24.
"""

from __future__ import annotations

from importlib.metadata import version

from packaging.version import Version

# A 5.24 pre-release may predate the rename; the old name works on both sides of it.
CACHE_ARGUMENT = "cache" if Version(version("transformers")) >= Version("5.24") else "past_key_values"


def with_cache(cache) -> dict:
    """Keyword arguments that hand ``cache`` (a transformers ``Cache``) to a model's forward."""
    return {CACHE_ARGUMENT: cache}
