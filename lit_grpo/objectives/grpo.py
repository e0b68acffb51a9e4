"""The GRPO loss: clipped surrogate + k3 KL, aggregated (docs/design.md, "The objective", 3-6).

Per token, ``l = -min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A) + beta*KL``
with ``rho = exp(logprobs - old_logprobs)``, ``A`` the completion's advantage
(or the token's, from a token-level estimator such as REINFORCE++) and the k3
estimator ``KL = exp(ref - logp) - (ref - logp) - 1``. Variants are tables:
``importance_level`` picks how rho is formed, ``loss_type`` how ``l`` is
averaged. Deliberate choices:

* Padding positions are zeroed *before* ``exp``, so garbage (even ``inf``) in
  padded log-probs can neither overflow nor leak NaN into the gradient.
* ``loss_type="grpo"`` divides by all N rows, empty ones included (each row's
  token count is clamped to 1, as TRL does): a row's weight is ``1/N``
  whatever its neighbours, and an all-padding micro-batch gives loss 0.
* ``beta == 0`` never reads ``ref_logprobs`` and leaves ``kl`` out of the
  metrics rather than report a made-up value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor


class LossOutput(NamedTuple):
    """What an objective returns.

    Attributes:
        loss: Scalar to backpropagate.
        metrics: Detached scalar tensors to log, keyed by metric name.
    """

    loss: Tensor
    metrics: dict[str, Tensor]


def at_least_fp32(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """The tensors in at least float32 (half precision is upcast, differentiably; fp64 stays).

    Every loss here computes in float32 whatever dtype its log-probs, values
    or scores arrive in: ratios, ``exp`` and the KL lose too much in bf16.
    """
    return tuple(
        t if t is None or not t.is_floating_point() else t.to(torch.promote_types(t.dtype, torch.float32))
        for t in tensors
    )


def _token_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    return log_ratio  # [N, T]


def _sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    # GSPO: one ratio per sequence, exp of the mean token log-ratio.
    return (_row_sums(log_ratio, mask) / _row_counts(mask)).unsqueeze(-1)  # [N, 1]


_IMPORTANCE_LEVELS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token": _token_log_ratio,
    "sequence": _sequence_log_ratio,
}


def _row_sums(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum(-1)  # [N]


def _row_counts(mask: Tensor) -> Tensor:
    return mask.sum(-1).clamp(min=1.0)  # [N]


def _mean_per_sequence(loss: Tensor, mask: Tensor, norm: float | Tensor | None) -> Tensor:
    return (_row_sums(loss, mask) / _row_counts(mask)).sum() / loss.shape[0]


def _mean_per_token(loss: Tensor, mask: Tensor, norm: float | Tensor | None) -> Tensor:
    return _row_sums(loss, mask).sum() / mask.sum().clamp(min=1.0)


def _sum_over_norm(loss: Tensor, mask: Tensor, norm: float | Tensor | None) -> Tensor:
    return _row_sums(loss, mask).sum() / norm


def _sum_over_rows_times_norm(loss: Tensor, mask: Tensor, norm: float | Tensor | None) -> Tensor:
    return _row_sums(loss, mask).sum() / (loss.shape[0] * norm)


class _Aggregation(NamedTuple):
    reduce: Callable[[Tensor, Tensor, float | Tensor | None], Tensor]
    norm_arg: str | None  # the grpo_loss keyword that supplies `norm`, if any


def _clipped(ratio: Tensor, adv: Tensor, logprobs: Tensor, options: dict) -> Tensor:
    # PPO's pessimistic clipped surrogate.
    clipped = torch.clamp(ratio, 1.0 - options["epsilon_low"], 1.0 + options["epsilon_high"])
    return -torch.minimum(ratio * adv, clipped * adv)


def _cispo(ratio: Tensor, adv: Tensor, logprobs: Tensor, options: dict) -> Tensor:
    # CISPO (MiniMax-M1): REINFORCE on log pi weighted by the importance ratio capped at 1 + epsilon_high and
    # detached; no token's gradient is switched off, a far-off one is only down-weighted.
    weight = torch.clamp(ratio, max=1.0 + options["epsilon_high"]).detach()
    return -weight * adv * logprobs


def _sapo(ratio: Tensor, adv: Tensor, logprobs: Tensor, options: dict) -> Tensor:
    # SAPO (Qwen): a soft gate 4/tau * sigmoid(tau * (ratio - 1)) in place of the hard clip; its slope is 1 at
    # ratio 1 (the policy gradient) and fades away from it, faster for negative advantages (tau_neg > tau_pos).
    tau = torch.where(adv > 0, options["sapo_temperature_pos"], options["sapo_temperature_neg"])
    return -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv


class _LossType(NamedTuple):
    surrogate: Callable[[Tensor, Tensor, Tensor, dict], Tensor]  # (ratio, adv, logprobs, options) -> [N, T]
    aggregation: _Aggregation


# How per-token losses become one number (PPO's policy term takes these too).
_AGGREGATIONS: dict[str, _Aggregation] = {
    "grpo": _Aggregation(_mean_per_sequence, None),
    "bnpo": _Aggregation(_mean_per_token, None),
    "dapo": _Aggregation(_sum_over_norm, "num_items"),
    "dr_grpo": _Aggregation(_sum_over_rows_times_norm, "max_completion_length"),
}
_LOSS_TYPES: dict[str, _LossType] = {
    **{name: _LossType(_clipped, aggregation) for name, aggregation in _AGGREGATIONS.items()},
    "cispo": _LossType(_cispo, _AGGREGATIONS["dapo"]),
    "sapo": _LossType(_sapo, _AGGREGATIONS["grpo"]),
}
# The accepted names, for callers that validate a config before any compute.
LOSS_TYPES = tuple(_LOSS_TYPES)
IMPORTANCE_LEVELS = tuple(_IMPORTANCE_LEVELS)
# The clip statistics grpo_loss reports, in this order (see _clip_metrics).
CLIP_METRICS = ("clip_ratio/low", "clip_ratio/high", "clip_ratio/region", "ratio/mean")


def _check_choice(name: str, value: str, table: dict) -> None:
    if value not in table:
        raise ValueError(f"{name} must be one of {sorted(table)}, got {value!r}")


def _check_shapes(logprobs: Tensor, advantages: Tensor, **same_as_logprobs: Tensor) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, T], got shape {tuple(logprobs.shape)}")
    for name, tensor in same_as_logprobs.items():
        if tensor.shape != logprobs.shape:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} does not match logprobs shape {tuple(logprobs.shape)}"
            )
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} does not match logprobs shape "
            f"{tuple(logprobs.shape)} (expected advantages [N] or [N, T] for logprobs [N, T])"
        )


def _check_norm(loss_type: str, name: str | None, value) -> None:
    if name is None:
        return
    if value is None:
        raise ValueError(f"loss_type={loss_type!r} needs {name}, got None")
    # A tensor (e.g. an all-reduced token count) is not checked: that would sync the device.
    if not isinstance(value, Tensor) and not value > 0:
        raise ValueError(f"{name} must be > 0 for loss_type={loss_type!r}, got {value}")


def _broadcastable_advantages(advantages: Tensor, real: Tensor) -> Tensor:
    if advantages.dim() == 1:
        return advantages.unsqueeze(-1)  # [N, 1], shared by the row's tokens
    return torch.where(real, advantages, 0.0)  # [N, T], padding zeroed so garbage there cannot leak NaN


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return ((values * mask).sum() / mask.sum().clamp(min=1.0)).detach()


def _k3_kl(ref_logprobs: Tensor, logprobs: Tensor, real: Tensor) -> Tensor:
    log_ref_ratio = torch.where(real, ref_logprobs - logprobs, 0.0)  # [N, T]
    return torch.exp(log_ref_ratio) - log_ref_ratio - 1.0  # [N, T], >= 0


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    ref_logprobs: Tensor | None = None,
    beta: float = 0.04,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    loss_type: str = "grpo",
    importance_level: str = "token",
    max_completion_length: int | None = None,
    num_items: int | float | Tensor | None = None,
    importance_weights: Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    entropies: Tensor | None = None,
    entropy_coef: float = 0.0,
    top_entropy_quantile: float = 1.0,
) -> LossOutput:
    """GRPO's policy surrogate with a k3 KL penalty (and an entropy bonus), aggregated by ``loss_type``.

    Args:
        logprobs: ``[N, T]`` log-probs of the sampled tokens under the current
            policy (with grad).
        old_logprobs: ``[N, T]`` log-probs under the rollout policy; pass
            ``logprobs.detach()`` when each rollout gets one optimizer step.
        advantages: ``[N]`` one advantage per completion, or ``[N, T]`` one
            per token (token-level estimators such as
            :func:`~lit_grpo.objectives.reinforce_pp_advantages`; padding
            positions are ignored).
        completion_mask: ``[N, T]`` 1 for real completion tokens (EOS
            included), 0 for padding; bool or numeric.
        ref_logprobs: ``[N, T]`` reference-policy log-probs; required iff
            ``beta > 0``.
        beta: KL coefficient; 0 skips the KL term entirely.
        epsilon_low: Lower clip range, ratio floored at ``1 - epsilon_low``.
        epsilon_high: Upper clip range, ratio capped at ``1 + epsilon_high``
            (0.28 is DAPO's clip-higher).
        loss_type: The clipped surrogate aggregated as "grpo" (mean over rows of
            each row's token mean), "bnpo" (token mean over the micro-batch),
            "dapo" (token sum / ``num_items``) or "dr_grpo" (token sum /
            (N * ``max_completion_length``)); or another surrogate: "cispo"
            (MiniMax-M1: ``-sg(min(ratio, 1 + epsilon_high)) * A * logprobs``,
            aggregated as "dapo") or "sapo" (Qwen's soft gate
            ``-4/tau * sigmoid(tau * (ratio - 1)) * A``, aggregated as "grpo").
        importance_level: "token" (one ratio per token) or "sequence" (GSPO:
            ``exp`` of the row's mean token log-ratio, shared by its tokens).
        max_completion_length: Generation length cap; required by "dr_grpo".
        num_items: Real completion tokens in the whole rollout batch (all
            accumulation steps and ranks); required by "dapo".
        importance_weights: ``[N, T]`` per-token weights of the clipped
            surrogate (not of the KL term), without grad: the truncated
            importance-sampling correction ``min(pi_old / pi_sampler, C)``
            for completions sampled by an engine whose distribution differs
            from the trainer's. ``None`` weighs every token 1.
        sapo_temperature_pos: "sapo"'s tau where the advantage is positive.
        sapo_temperature_neg: "sapo"'s tau elsewhere (larger: the gate closes faster).
        entropies: ``[N, T]`` the policy's entropy at each position; required by
            ``entropy_coef > 0`` (with grad) and ``top_entropy_quantile < 1``.
        entropy_coef: Weight of the entropy bonus: ``entropy_coef`` times the
            entropy, aggregated like the surrogate, is subtracted from the loss.
        top_entropy_quantile: Train the surrogate on this fraction of the real
            tokens with the highest entropy only (TRL's ``top_entropy_quantile``,
            the "80/20" forking tokens; computed over this micro-batch); 1.0
            trains on all. The KL term keeps every token.

    Returns:
        :class:`LossOutput`: scalar ``loss``; ``metrics`` with ``clip_ratio/low``,
        ``clip_ratio/high``, ``clip_ratio/region`` (fractions of real tokens
        where the clip is active), ``ratio/mean`` and, when ``beta > 0``, ``kl``
        (mean over real tokens).

    Raises:
        ValueError: Unknown ``loss_type``/``importance_level``, mismatched
            shapes, ``beta > 0`` without ``ref_logprobs``, or the
            normaliser that ``loss_type`` needs missing or not positive.
    """
    _check_choice("loss_type", loss_type, _LOSS_TYPES)
    _check_choice("importance_level", importance_level, _IMPORTANCE_LEVELS)
    if not 0 < top_entropy_quantile <= 1:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {top_entropy_quantile}")
    if entropies is None and (entropy_coef != 0 or top_entropy_quantile < 1):
        raise ValueError("entropy_coef != 0 or top_entropy_quantile < 1 needs entropies; pass them")
    surrogate, aggregation = _LOSS_TYPES[loss_type]
    norm = {"num_items": num_items, "max_completion_length": max_completion_length}.get(aggregation.norm_arg)
    _check_norm(loss_type, aggregation.norm_arg, norm)
    if beta > 0 and ref_logprobs is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logprobs; pass them or set beta=0")
    with_ref = {"ref_logprobs": ref_logprobs} if beta > 0 else {}
    _check_shapes(logprobs, advantages, old_logprobs=old_logprobs, completion_mask=completion_mask, **with_ref)

    logprobs, old_logprobs, advantages, importance_weights = at_least_fp32(
        logprobs, old_logprobs, advantages, importance_weights
    )
    if beta > 0:
        (ref_logprobs,) = at_least_fp32(ref_logprobs)
    real = completion_mask.bool()  # [N, T]
    mask = real.to(logprobs.dtype)  # [N, T]
    log_ratio = torch.where(real, logprobs - old_logprobs, 0.0)  # [N, T]
    ratio = torch.exp(_IMPORTANCE_LEVELS[importance_level](log_ratio, mask))  # [N, T] or [N, 1]
    adv = _broadcastable_advantages(advantages.to(logprobs.dtype), real)  # [N, 1] or [N, T]
    options = {
        "epsilon_low": epsilon_low,
        "epsilon_high": epsilon_high,
        "sapo_temperature_pos": sapo_temperature_pos,
        "sapo_temperature_neg": sapo_temperature_neg,
    }
    masked_logprobs = torch.where(real, logprobs, 0.0)  # [N, T]
    per_token = surrogate(ratio, adv, masked_logprobs, options).expand_as(mask)  # [N, T]
    if importance_weights is not None:
        _check_shapes(logprobs, advantages, importance_weights=importance_weights)
        per_token = per_token * importance_weights.detach().to(per_token.dtype)

    metrics = _clip_metrics(ratio.detach().expand_as(mask), adv, mask, epsilon_low, epsilon_high)
    if entropies is not None:
        _check_shapes(logprobs, advantages, entropies=entropies)
        (entropies,) = at_least_fp32(entropies)
        entropies = torch.where(real, entropies, 0.0)  # [N, T]
        if top_entropy_quantile < 1:
            keep = high_entropy_mask(entropies.detach(), real, top_entropy_quantile)  # [N, T]
            per_token = per_token * keep
            metrics["entropy/trained_fraction"] = _masked_mean(keep, mask)
        if entropy_coef != 0:
            per_token = per_token - entropy_coef * entropies
    if beta > 0:
        kl = _k3_kl(ref_logprobs, logprobs, real)  # [N, T]
        per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl, mask)
    loss = aggregation.reduce(per_token, mask, norm)
    return LossOutput(loss=loss, metrics=metrics)


def high_entropy_mask(entropies: Tensor, real: Tensor, quantile: float) -> Tensor:
    """``[N, T]`` 1.0 at the real tokens whose entropy is among the top ``quantile`` of the real tokens'
    (at or above their ``1 - quantile`` quantile), 0.0 elsewhere."""
    values = entropies[real]
    if values.numel() == 0:
        return real.to(entropies.dtype)
    threshold = torch.quantile(values.float(), 1.0 - quantile)
    return (real & (entropies >= threshold)).to(entropies.dtype)


def _clip_metrics(
    ratio: Tensor, adv: Tensor, mask: Tensor, epsilon_low: float, epsilon_high: float
) -> dict[str, Tensor]:
    # The clip binds only where it lowers the objective: below the range for
    # A < 0, above it for A > 0 (elsewhere min() picks the unclipped term).
    low = ((ratio < 1.0 - epsilon_low) & (adv < 0)).to(mask.dtype)  # [N, T]
    high = ((ratio > 1.0 + epsilon_high) & (adv > 0)).to(mask.dtype)  # [N, T]
    values = (low, high, low + high, ratio)
    return {name: _masked_mean(value, mask) for name, value in zip(CLIP_METRICS, values)}


def sampler_gap(
    old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, cap: float | None = None
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """How far the sampler's distribution is from the trainer's, and the TIS weights.

    ``delta = log pi_old - log pi_sampler`` per sampled token; reported as its
    mean absolute value and as the k3 estimate of KL(sampler || trainer)
    (``exp(delta) - 1 - delta``), both averaged over the sampled tokens
    (``mask``). The truncated importance-sampling weights ``min(exp(delta), cap)``
    are returned only when ``cap`` is set, with the share of sampled tokens
    whose weight the cap cut (0 without a cap).

    Returns:
        ``(weights [N, T] or None, {"sampler/logprob_abs_diff": [], "sampler/kl": [],
        "sampler/is_capped_fraction": []})``.
    """
    delta = (old_logprobs.detach() - sampler_logprobs) * mask  # [N, T], 0 where not sampled
    real = mask.sum().clamp(min=1)
    capped = ((delta.exp() > cap) & mask.bool()).sum() / real if cap else delta.new_zeros(())
    metrics = {
        "sampler/logprob_abs_diff": delta.abs().sum() / real,
        "sampler/kl": (delta.exp() - 1 - delta).sum() / real,
        "sampler/is_capped_fraction": capped,
    }
    return (delta.exp().clamp(max=cap) if cap else None), metrics
