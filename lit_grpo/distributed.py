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
reshards afterwards: about 3x faster than per-step gathers on CPU/gloo, for
one full copy of the weights held while sampling.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard


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
