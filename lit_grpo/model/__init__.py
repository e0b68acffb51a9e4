"""The policy model: loading it, scoring completions with it, and models to test on.

:mod:`~lit_grpo.model.policy`: the causal LM, its tokenizer and the LoRA/QLoRA adapter that trains
(PolicySpec, LoraSpec); :mod:`~lit_grpo.model.sources`: where it comes from (the embedded SmolLM2, a
saved folder, the hub); :mod:`~lit_grpo.model.attention`: the ``sdpa_gqa`` attention (grouped-query
attention left to the kernel); :mod:`~lit_grpo.model.logprob_passes`: the policy's per-token
log-prob passes over rollout completions; :mod:`~lit_grpo.model.random_models`: randomly initialised
models of real shapes, with a tokenizer built in code; :mod:`~lit_grpo.model.adapters`: switching
which of several LoRA adapters on one frozen base runs; :mod:`~lit_grpo.model.refusals`: a
third-party constructor's refusal, reported against the config field that carried the value;
:mod:`~lit_grpo.model.kv_cache`: handing our KV cache to a transformers model under the name its
version reads; :mod:`~lit_grpo.model.hardware`: the device's peak matmul rate and the dtype
``policy.dtype: auto`` picks.
"""

import logging

# bitsandbytes (which peft imports) tries to fetch its CPU 4-bit kernel from the hub's kernels-community
# when it is imported, and logs a warning when it cannot (no hub, or a repository it does not trust);
# its own CPU path runs instead. Nothing a run can act on, 4-bit or not: that one message is dropped.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")
)
