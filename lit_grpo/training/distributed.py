"""FSDP2 for the policy: shard it per decoder layer, gather it once to sample.

Lightning's ``ModelParallelStrategy`` gives the LightningModule a device mesh
and expects ``configure_model`` to apply ``fully_shard``;
``PolicyModule.configure_model`` calls :func:`shard` there. Each decoder layer
is its own FSDP unit (gathered just before it runs, freed after it), and the
model root holds the rest (embeddings, final norm, output head).

Sampling is the exception. The rollout's decode loop calls the model's
``forward`` once per new token (not ``model.generate``, so no
``register_fsdp_forward_method`` is needed), and with per-layer resharding
every decoding step would all-gather every layer again. :func:`gathered`
unshards every unit once, keeps the full weights for the whole rollout and
reshards afterwards: one gather a rollout instead of one a decoding step, for
one full copy of the weights held while sampling.

Logged metrics are the other place where ranks must meet. Lightning's
``self.log(..., sync_dist=True)`` reduces an epoch value lazily, wherever it
is first read; at the end of a training epoch that is the progress bar, which
only rank 0 draws, while the other ranks are already in their next
collective, and the job deadlocks (two ranks waiting in different
collectives). :func:`reduce_across_ranks` reduces values eagerly instead, at
a point every rank reaches in step, so what gets logged is already the same
on every rank and needs no sync at read time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a Hugging Face model.

    They are the classes the model lists in ``_no_split_modules`` (the same
    declaration ``device_map="auto"`` uses to keep a block on one device).
    """
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} declares no decoder layer class (_no_split_modules), so it "
            "cannot be sharded layer by layer with FSDP2."
        )
    return layers


def shard(model: nn.Module, mesh: DeviceMesh) -> None:
    """Apply FSDP2 to each decoder layer, then to the whole model, in place.

    Calling it again on a sharded model does nothing (Lightning may call
    ``configure_model`` more than once).
    """
    if isinstance(model, FSDPModule):
        return
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each named tensor whole and on the CPU, FSDP2 shards gathered first.

    A collective when any tensor is sharded: every rank must call it with the
    same names in the same order.
    """
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu() for name, t in named}


@contextlib.contextmanager
def gathered(*models: nn.Module | None):
    """Keep every FSDP unit of ``models`` unsharded inside the block.

    Models that are not sharded (or ``None``) pass through untouched.
    """
    units = [m for model in models if model is not None for m in model.modules() if isinstance(m, FSDPModule)]
    roots = {id(model) for model in models}
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            # A root never reshards after forward (its weights are needed first
            # in backward); only the layers go back to resharding.
            if id(unit) not in roots:
                unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()


def reduce_across_ranks(
    strategy,
    values: Mapping[str, float | torch.Tensor],
    weight: float = 1.0,
    op: Literal["mean", "max"] = "mean",
) -> tuple[dict[str, float], float]:
    """Reduce scalar ``values`` over all ranks now, in one collective.

    A collective: every rank must call it at the same point with the same
    keys in the same order. ``mean`` is the mean weighted by each rank's
    ``weight`` (a rank with nothing to report passes weight 0); ``max`` the
    largest value. Returns the reduced values (identical on every rank) and
    the total weight; with total weight 0 the means are NaN.

    Args:
        strategy: The Trainer's strategy (its ``reduce`` is the identity on
            one process).
        values: Scalar metrics of this rank.
        weight: This rank's weight for ``mean`` (e.g. its number of rows).
        op: ``mean`` or ``max``.
    """
    local = torch.tensor([float(v) for v in values.values()], dtype=torch.float64)  # [K]
    if op == "max":
        reduced = strategy.reduce(local.to(strategy.root_device), reduce_op="max").cpu()
        return dict(zip(values, reduced.tolist())), weight
    packed = torch.cat([local * weight, torch.tensor([weight], dtype=torch.float64)])  # [K + 1]
    total = strategy.reduce(packed.to(strategy.root_device), reduce_op="sum").cpu()
    means = (total[:-1] / total[-1]).tolist() if total[-1] > 0 else [float("nan")] * len(values)
    return dict(zip(values, means)), float(total[-1])


def gather_to_rank_zero(obj, world_size: int) -> list | None:
    """Every rank's picklable ``obj`` in rank order on rank 0, ``None`` elsewhere.

    A collective (every rank calls it); on one process it is ``[obj]``.
    """
    if world_size == 1 or not torch.distributed.is_initialized():
        return [obj]
    gathered_objects = [None] * world_size if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(obj, gathered_objects, dst=0)
    return gathered_objects
