"""The vLLM engine: vLLM colocated in the training process, one engine per rank.

How it works with training:

* **One engine per rank, in this process** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
  tensor parallel 1). Each rank samples its own prompts, as with the native
  engine. The engine is started at the first rollout with random ("dummy")
  weights and then receives the policy's, so it always samples from exactly
  what trains, whatever the checkpoint on disk holds.
* **Weights after every optimizer step**, pushed before the next sampling
  call without restarting the engine: the LoRA adapter is folded into the
  weights (:func:`lit_grpo.generation.merged.merged_weights`; FSDP2 shards are gathered
  first) and vLLM reloads the adapted layers in place
  (``reload_weights(..., is_checkpoint_format=True)``, which repacks them for
  its kernels), then its prefix cache is cleared. Only the adapted layers
  move after the first push; full fine-tuning pushes everything.
* **Bounded memory**: the KV cache gets ``generation.kv_cache_gb`` (vLLM would
  otherwise reserve 90% of the device, which on a CPU is the RAM). Prefix
  caching is on, so a group's prompt is prefilled once for its G samples.
* **Reproducible**: each sampling call draws one seed from torch's global
  generator, which the DataModule seeds from ``(seed, epoch, rank)``, and
  vLLM samples from the global generator re-seeded with it (then restored).
  The engine's scheduling is deterministic for the same requests, so a
  resumed run regenerates exactly what the uninterrupted one did.
* **Side effects contained**: starting vLLM re-seeds the global RNGs and, on
  CPUs, replaces ``torch.set_num_threads`` with a no-op; both are put back.
* **Log-probs**: vLLM returns each sampled token's log-prob under the
  distribution it drew from (``logprobs_mode="processed_logprobs"``:
  temperature, then top-k/top-p), which the training step compares with the
  trainer's (``sampler/*`` metrics) and may correct for
  (``generation.importance_sampling_cap``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from lit_grpo.generation.episodes import Episodes, play_turns
from lit_grpo.generation.merged import merged_weights, trained_weight_names
from lit_grpo.generation.rollout import Rollout, SamplingSpec, eos_ids, finish_rollout
from lit_grpo.model.policy import DTYPES, EMBEDDED
from lit_grpo.model.sources import embedded_model_dir
from lit_grpo.training.distributed import gathered


class VLLMEngine:
    """Samples with a colocated vLLM engine (see the module docstring).

    Args:
        spec: The generation settings (``dtype``, ``kv_cache_gb``, ``max_model_len``).
        module: The training module: its ``policy``, ``tokenizer`` and
            ``spec`` are read, and its DataModule's prompt length.

    Raises:
        ValueError: A policy this engine cannot mirror (4-bit base weights, a GGUF file).
    """

    def __init__(self, spec, module) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines would bury the progress bars
        check_policy(module.spec)
        self.spec, self.module = spec, module
        self.llm = None  # started at the first call, when the longest sequence is known
        self.max_len = 0  # the engine's context length (prompt + completion), set at its start
        self.pushed: set[str] | None = None  # names pushed after the first (full) push
        self.stale = True  # the engine's weights are behind the policy's
        self.push_seconds = 0.0  # spent pushing weights, over the engine's life

    # ------------------------------------------------------------- sampling
    def generate(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        sampling: SamplingSpec,
        *,
        greedy: bool = False,
        repeat: int | None = None,
        progress=None,
        episodes=None,
    ) -> Rollout:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        repeat = repeat or (1 if greedy else sampling.group_size)
        longest = prompt_ids.shape[1] + (sampling.max_new_tokens if episodes is None else episodes.max_episode_tokens)
        if self.llm is None:
            self._start(longest)
        if longest > self.max_len:  # vLLM would silently stop every completion at its context length
            raise ValueError(
                f"a prompt of {prompt_ids.shape[1]} tokens + sampling.max_new_tokens="
                f"{sampling.max_new_tokens} needs {longest} tokens, more than the vLLM engine's "
                f"context of {self.max_len}; raise model.generation.max_model_len."
            )
        if self.stale:
            self.push_weights()
        tokenizer = self.module.tokenizer
        eos = [] if sampling.ignore_eos else eos_ids(tokenizer, self.module.policy)
        prompts = [
            TokensPrompt(prompt_token_ids=row[mask.bool()].tolist())
            for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())
        ]
        # Greedy decoding draws nothing; sampling draws one seed per call from the caller's seeded RNG.
        # vLLM samples from torch's global generator when requests carry no seed of their own (and on
        # CPUs a per-request seed fails once a long prefill is split across steps).
        seed = None if greedy else int(torch.randint(0, 2**62, ()))
        if episodes is not None:
            return self._episodes(prompts, prompt_ids, prompt_mask, repeat, sampling, greedy, eos, seed, episodes)
        params = SamplingParams(
            n=repeat,
            max_tokens=sampling.max_new_tokens,
            temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=0 if greedy else sampling.top_k,
            stop_token_ids=eos,
            ignore_eos=sampling.ignore_eos,
            logprobs=None if greedy else 0,
            detokenize=False,
        )
        start = time.perf_counter()
        with _contained():  # the caller's RNG state is back afterwards, advanced by the one draw above
            if seed is not None:
                torch.manual_seed(seed)
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        if progress is not None:
            progress.update(sampling.max_new_tokens)
            progress.close()
        return self._rollout(outputs, prompt_ids, prompt_mask, repeat, sampling, greedy, eos, seconds)

    def _episodes(self, prompts, prompt_ids, prompt_mask, repeat, sampling, greedy, eos, seed, spec) -> Rollout:
        """Episodes (:mod:`lit_grpo.generation.episodes`): each turn re-submits every live row's
        prompt + trajectory (the prefix cache holds what was read before); all calls of a turn run together."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        state = Episodes(spec, self.module.tokenizer, sampling.max_new_tokens, eos)
        contexts = [p["prompt_token_ids"] for p in prompts for _ in range(repeat)]

        def sample_turns(rows: list[int], texts: list[list[int]], rooms: list[int]):
            params = [
                SamplingParams(
                    n=1,
                    max_tokens=room,
                    temperature=0.0 if greedy else sampling.temperature,
                    top_p=1.0 if greedy else sampling.top_p,
                    top_k=0 if greedy else sampling.top_k,
                    stop_token_ids=eos,
                    stop=[spec.call_format.stop],
                    include_stop_str_in_output=True,
                    logprobs=None if greedy else 0,
                    detokenize=True,
                )
                for room in rooms
            ]
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=text) for text in texts], params, use_tqdm=False)
            turns = []
            for output in outputs:
                sample = output.outputs[0]
                turns.append(
                    (
                        list(sample.token_ids),
                        None
                        if greedy
                        else [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)],
                    )
                )
            return turns

        start = time.perf_counter()
        with _contained():
            if seed is not None:
                torch.manual_seed(seed)
            play_turns(state, contexts, sample_turns)
        return state.rollout(prompt_ids.cpu(), prompt_mask.cpu(), repeat, greedy, time.perf_counter() - start)

    def _rollout(self, outputs, prompt_ids, prompt_mask, repeat, sampling, greedy, eos, seconds) -> Rollout:
        """vLLM's request outputs as a :class:`Rollout` (rows of one prompt contiguous)."""
        tokenizer = self.module.tokenizer
        n = len(outputs) * repeat
        completion_ids = torch.full((n, sampling.max_new_tokens), tokenizer.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(n, sampling.max_new_tokens)
        for i, sample in enumerate(s for output in outputs for s in output.outputs):
            ids = list(sample.token_ids)
            completion_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            if not greedy:
                logprobs[i, : len(ids)] = torch.tensor(
                    [step[token].logprob for step, token in zip(sample.logprobs, ids)]
                )
        return finish_rollout(
            tokenizer,
            prompt_ids.cpu(),
            prompt_mask.cpu(),
            repeat,
            completion_ids,
            None if greedy else logprobs,
            eos,
            seconds,
        )

    # ------------------------------------------------------------- weights
    def weights_changed(self) -> None:
        self.stale = True

    @torch.no_grad()
    def push_weights(self) -> None:
        """Copy the policy's current (merged) weights into the engine."""
        start = time.perf_counter()
        policy = self.module.policy
        dtype = _torch_dtype(self.spec, self.module)
        with gathered(policy):
            weights = merged_weights(policy)
            if self.pushed is not None:
                weights = {name: w for name, w in weights.items() if name in self.pushed}
            batch = [
                (name, w.detach().to("cpu" if self._on_cpu else w.device, dtype).contiguous())
                for name, w in weights.items()
            ]
        with _contained():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": batch, "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()
        if self.pushed is None:
            self.pushed = trained_weight_names(policy)
        self.stale = False
        self.push_seconds += time.perf_counter() - start

    # ------------------------------------------------------------- lifecycle
    def _start(self, longest: int) -> None:
        from vllm import LLM

        module = self.module
        self.max_len = self.spec.max_model_len or max(longest, _planned_length(module))
        self._on_cpu = module.device.type == "cpu"
        if _distributed():  # vLLM's external launcher reads the rank from the environment
            os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
            os.environ.setdefault("LOCAL_RANK", str(module.local_rank))
            os.environ.setdefault("WORLD_SIZE", str(torch.distributed.get_world_size()))
        with _contained():
            self.llm = LLM(
                model=str(embedded_model_dir() if module.spec.name_or_path == EMBEDDED else module.spec.name_or_path),
                load_format="dummy",  # the policy's weights are pushed before the first request
                dtype=_dtype_name(_torch_dtype(self.spec, module)),
                seed=0,
                enforce_eager=True,
                enable_prefix_caching=True,
                kv_cache_memory_bytes=int(self.spec.kv_cache_gb * 2**30),
                max_model_len=self.max_len,
                logprobs_mode="processed_logprobs",
                disable_log_stats=True,
                # Under DDP/FSDP each rank's engine joins the process group the trainer
                # launched instead of starting its own (tensor parallel 1: one engine per rank).
                distributed_executor_backend="external_launcher" if _distributed() else None,
            )
        # A partial push (only the adapted layers) is expected to leave the rest as it is.
        logging.getLogger("vllm.model_executor.model_loader.reload").setLevel(logging.ERROR)

    def close(self) -> None:
        if self.llm is not None:
            with contextlib.suppress(Exception):
                self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            self.pushed, self.stale = None, True


def check_policy(policy_spec) -> None:
    """Refuse a policy the vLLM engine cannot mirror, naming the field.

    Raises:
        ValueError: 4-bit base weights (QLoRA) or a GGUF file.
    """
    if policy_spec.load_in_4bit:
        raise ValueError(
            "model.generation.backend='vllm' with model.policy.load_in_4bit=true is not "
            "supported: vLLM would need the 4-bit weights de-quantized each step; use the "
            "native engine for QLoRA."
        )
    if policy_spec.gguf_file:
        raise ValueError(
            f"model.generation.backend='vllm' cannot start from policy.gguf_file="
            f"{policy_spec.gguf_file!r}; convert it to a safetensors folder first."
        )


def _planned_length(module) -> int:
    """Longest prompt + completion the DataModule will ask for (0 when unknown)."""
    datamodule = getattr(module.trainer, "datamodule", None) if module._trainer else None
    if datamodule is None:
        return 0
    return (datamodule.prompt.max_length or 0) + datamodule.sampling.max_new_tokens


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _torch_dtype(spec, module) -> torch.dtype:
    return DTYPES[spec.dtype] if spec.dtype else module.spec.torch_dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


@contextlib.contextmanager
def _contained() -> Iterator[None]:
    """Undo vLLM's process-wide side effects: global RNG re-seeds and, on CPUs, a
    ``torch.set_num_threads`` turned into a no-op (and a changed thread count)."""
    rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
