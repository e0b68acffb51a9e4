"""Model FLOPs of the training passes and the rollout: what ``perf/mfu`` counts.

The count is the work the model needs, not what an implementation happens to
run (the PaLM paper's *model* FLOPs; recomputation under gradient
checkpointing is not counted):

* A forward pass costs ``2 * in * out`` FLOPs per token for each linear layer
  (the output head and the LoRA matrices included; the reference pass runs
  without the adapter), plus ``4 * layers * heads * head_dim`` per
  (query, key) pair the causal attention scores.
* A backward pass costs the same again for the input gradients, plus
  ``2 * in * out`` per token for each linear layer whose weight trains (only
  the adapter under LoRA, every layer under full fine-tuning), and twice the
  forward's attention.
* Rows that share a prompt need it once: a rollout's G completions of a
  prompt count its tokens one time (what the shared-prompt passes and a KV
  cache run), each completion its own tokens attending to the prompt and to
  its own earlier tokens.

Generation is counted as the forward of the prompts and of every sampled
token (a KV cache's work); its decode steps are few-row matmuls, bound by
memory bandwidth rather than by the matmul peak, so ``perf/rollout_mfu`` is
low by nature on a GPU. ``perf/rollout_roofline`` measures the rollout against
the roofline: the least time it could take, the larger of the bytes it must
read (every weight once per decode step, and the cached keys and values each
new token attends to) over the device's measured read bandwidth and its FLOPs
over the peak, divided by the seconds it took. 1.0 is a rollout at the
roofline; which bound binds depends on the rows per decode step and the device
(a GPU decoding a few dozen rows is bound by bandwidth, one CPU core by its
matmul rate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class FlopModel:
    """Per-token costs of one model, read off its layers once.

    Attributes:
        base_linear: Sum of ``in * out`` over the linear layers that are not
            adapter matrices (head included).
        adapter_linear: The same over LoRA matrices.
        trained_linear: The same over linear layers whose weight trains.
        attention: ``layers * heads * head_dim`` (0 when the config does not say).
        weight_bytes: Bytes of the linear layers' weights as stored (4-bit ones packed): what every
            decode step reads.
        kv_bytes: Bytes of one token's keys and values over all layers, in the weights' dtype: what a
            decode step reads per cached token it attends to.
    """

    base_linear: int
    adapter_linear: int
    trained_linear: int
    attention: int
    weight_bytes: int = 0
    kv_bytes: int = 0

    @classmethod
    def of(cls, model: nn.Module) -> FlopModel:
        """Read the costs of ``model`` (a causal LM, or a peft model wrapping one)."""
        base = adapter = trained = weight_bytes = 0
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            weight_bytes += module.weight.numel() * module.weight.element_size()
            size = module.in_features * module.out_features  # not weight.numel(): 4-bit weights are packed
            if "lora_" in name:
                adapter += size
            else:
                base += size
            if module.weight.requires_grad:
                trained += size
        config = getattr(model, "config", None)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        layers = getattr(config, "num_hidden_layers", 0) or 0
        heads = getattr(config, "num_attention_heads", 0) or 0
        head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // heads if heads else 0)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        element = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
        kv_bytes = 2 * layers * kv_heads * head_dim * element
        return cls(base, adapter, trained, layers * heads * head_dim, weight_bytes, kv_bytes)

    def decode_bytes(self, steps: float, pairs: float) -> float:
        """Bytes a KV-cached decode reads from memory: every weight once per step, and the cached keys and
        values of each (query, key) pair (:func:`completion_pairs`)."""
        return self.weight_bytes * steps + self.kv_bytes * pairs

    def forward(self, tokens: float, pairs: float, adapter: bool = True) -> float:
        """FLOPs of a forward over ``tokens`` tokens scoring ``pairs`` (query, key) pairs."""
        linear = self.base_linear + (self.adapter_linear if adapter else 0)
        return 2.0 * linear * tokens + 4.0 * self.attention * pairs

    def forward_backward(self, tokens: float, pairs: float) -> float:
        """FLOPs of a training pass (forward and backward) with the adapter on."""
        backward = 2.0 * (self.base_linear + self.adapter_linear + self.trained_linear) * tokens
        return self.forward(tokens, pairs) + backward + 8.0 * self.attention * pairs


def rollout_tokens(prompt_ids: Tensor, prompt_mask: Tensor, attention: Tensor) -> tuple[float, float]:
    """``(tokens, pairs)`` the model needs for these rows, each distinct prompt counted once.

    Args:
        prompt_ids: ``[N, P]`` left-padded prompts.
        prompt_mask: ``[N, P]`` 1 for real prompt tokens.
        attention: ``[N, C]`` 1 for every real completion token (the
            episode's tool tokens included: the model reads them).
    """
    prompt_len = prompt_mask.sum(-1).double()  # [N]
    _, first = _first_of_each(prompt_ids)
    shared = prompt_len[first]  # [distinct]
    tokens = shared.sum() + attention.sum()
    return float(tokens), float((shared * (shared + 1) / 2).sum()) + completion_pairs(prompt_mask, attention)


def completion_pairs(prompt_mask: Tensor, attention: Tensor) -> float:
    """The (query, key) pairs of the completion tokens: each attends to its prompt and to its own earlier
    tokens. In a KV-cached decode, the cache entries its steps read."""
    prompt_len = prompt_mask.sum(-1).double()  # [N]
    completion_len = attention.sum(-1).double()  # [N]
    return float((completion_len * prompt_len + completion_len * (completion_len + 1) / 2).sum())


def _first_of_each(rows: Tensor) -> tuple[Tensor, Tensor]:
    """``(inverse [N], first [distinct])``: each row's distinct-row index, and where each first occurs."""
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)  # [N]
    positions = torch.arange(len(inverse), device=inverse.device)
    first = torch.full((int(inverse.max()) + 1 if len(inverse) else 0,), len(inverse), device=inverse.device)
    return inverse, first.scatter_reduce(0, inverse, positions, reduce="amin")


# Phases of an epoch's step (logged as time/<phase>) that run the training passes.
TRAINING_PHASES = ("policy_forward", "policy_backward", "reference", "old_logprobs")


class EpochThroughput:
    """One epoch's FLOPs and trained tokens, turned into the ``perf/*`` metrics.

    Args:
        flops: The model's per-token costs.
        peak: The device's peak FLOP/s (:func:`lit_grpo.model.hardware.peak_flops`).
        bandwidth: The device's memory read bandwidth in bytes/s
            (:func:`lit_grpo.model.hardware.peak_bandwidth`); 0 leaves ``perf/rollout_roofline`` out.
    """

    def __init__(self, flops: FlopModel, peak: float, bandwidth: float = 0.0) -> None:
        self.costs, self.peak, self.bandwidth = flops, peak, bandwidth
        self.reset()

    def reset(self) -> None:
        """Forget the epoch counted so far."""
        self.training_flops = self.generation_flops = self.trained_tokens = self.decode_bytes = 0.0

    def rollout(self, counts: dict[str, float]) -> None:
        """Count a rollout's generation and its scoring passes (reference, old log-probs).

        Args:
            counts: :attr:`~lit_grpo.rollout.producer.ScoredRollout.counts`: the rows'
                ``tokens`` and ``pairs`` (:func:`rollout_tokens`), the completions'
                ``decode_pairs`` (:func:`completion_pairs`) and the ``decode_steps`` run,
                the ``generated`` and ``kept`` tokens, and which passes ran (``reference``, ``old``).
        """
        tokens, pairs = counts["tokens"], counts["pairs"]
        passes = [False] * bool(counts["reference"]) + [True] * bool(counts["old"])  # adapter off / on
        self.training_flops += sum(self.costs.forward(tokens, pairs, adapter=on) for on in passes)
        kept, generated = counts["kept"], counts["generated"]
        # Dynamic sampling's dropped groups were sampled too: the kept rows' cost, scaled to all tokens sampled.
        scale = generated / kept if kept and generated else 1.0
        self.generation_flops += scale * self.costs.forward(tokens, pairs)
        # (a rollout restored from a checkpoint of an earlier version has no decode counts)
        self.decode_bytes += self.costs.decode_bytes(
            counts.get("decode_steps", 0.0), scale * counts.get("decode_pairs", 0.0)
        )

    def step(self, rows: dict[str, Tensor]) -> None:
        """Count one micro-batch's training pass (forward and backward) over ``rows``."""
        attention = rows.get("completion_attention", rows["completion_mask"])
        self.training_flops += self.costs.forward_backward(
            *rollout_tokens(rows["prompt_ids"], rows["prompt_mask"], attention)
        )
        self.trained_tokens += float(rows["completion_mask"].sum())

    def metrics(self, seconds: dict[str, float]) -> dict[str, float]:
        """``perf/tokens_per_s``, ``perf/mfu`` and ``perf/rollout_mfu`` from the epoch's phase seconds.

        Args:
            seconds: Seconds per phase (``generate``, ``reward``, the
                :data:`TRAINING_PHASES`, ``optimizer``...); missing ones are 0.
        """
        training = sum(seconds.get(phase, 0.0) for phase in TRAINING_PHASES)
        generate = seconds.get("generate", 0.0)
        total = sum(seconds.values())
        metrics = {
            "perf/tokens_per_s": self.trained_tokens / total if total > 0 else 0.0,
            "perf/mfu": self.training_flops / training / self.peak if training > 0 else 0.0,
            "perf/rollout_mfu": self.generation_flops / generate / self.peak if generate > 0 else 0.0,
        }
        if self.bandwidth > 0:  # the same keys on every rank (they are reduced): the bandwidth is broadcast
            bound = max(self.decode_bytes / self.bandwidth, self.generation_flops / self.peak)
            metrics["perf/rollout_roofline"] = bound / generate if generate > 0 else 0.0
        return metrics
