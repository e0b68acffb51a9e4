"""What keeps a training run going, and safe when it stops: checkpoints, ranks, strategies, guards.

:mod:`~lit_grpo.training.checkpointing`: crash-safe checkpoint files, and the checks on a checkpoint
to resume from; :mod:`~lit_grpo.training.distributed`: FSDP2 for the policy (sharded per decoder
layer, gathered once to sample) and the collectives; :mod:`~lit_grpo.training.multiprocess`: the
guards that end a multi-process run instead of leaving it idle;
:mod:`~lit_grpo.training.strategies`: which Lightning strategies lit_grpo trains under, checked
before any weights load; :mod:`~lit_grpo.training.guard`: skipping optimizer steps whose gradient is
not finite, and stopping if it persists; :mod:`~lit_grpo.training.host_memory`: giving freed host
memory back to the OS; :mod:`~lit_grpo.training.throughput`: the model FLOPs behind ``perf/mfu``.
"""
