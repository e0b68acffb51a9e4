"""Set-up checks of the on-policy DataModule: the advantage estimator against the module and the
group size, and the prompt budget against ranks and micro-batches (before any sampling)."""

from __future__ import annotations

from lit_grpo.rollout.estimators import ESTIMATORS


def choose_estimator(data) -> None:
    """Resolve ``data.advantage.estimator`` against what the module can train with, and its group size."""
    module = data.trainer.lightning_module if data.trainer else None
    accepted = getattr(module, "ADVANTAGE_ESTIMATORS", ("grpo", "rloo"))
    name = data.advantage.estimator or accepted[0]
    if name not in ESTIMATORS or name not in accepted:
        owner = type(module).__name__ if module is not None else "GRPOModule"
        raise ValueError(
            f"data.advantage.estimator={name!r}; {owner} trains with one of "
            f"{list(accepted)} (or null for {accepted[0]!r})."
        )
    G = data.sampling.group_size
    if ESTIMATORS[name].needs_group and G < 2:
        raise ValueError(
            f"sampling.group_size={G}; expected >= 2 with data.advantage.estimator={name!r} (its baseline "
            "comes from the other completions of the same prompt); sample more per prompt, or train a "
            "critic (PPOModule, data.advantage.estimator 'gae'), which works with 1."
        )
    if data.hparams.dynamic_sampling and G < 2:
        raise ValueError(f"data.dynamic_sampling=true needs sampling.group_size >= 2, got {G}.")
    data.advantage_estimator = name


def check_prompt_budget(data) -> None:
    """Refuse prompts that do not split over the ranks, micro-batches that do not divide a rollout."""
    hp = data.hparams
    check_batch_arithmetic(
        hp.prompts_per_epoch,
        data.sampling.group_size,
        hp.batch_size,
        hp.num_iterations,
        data.trainer.accumulate_grad_batches if data.trainer else 1,
        data.trainer.world_size if data.trainer else 1,
    )
    if not hp.repeat and hp.prompts_per_epoch > len(data.train_rows):
        raise ValueError(
            f"data.prompts_per_epoch={hp.prompts_per_epoch} exceeds the {len(data.train_rows)} "
            "training prompts; set data.repeat=true to cycle through them."
        )


def check_batch_arithmetic(
    prompts_per_epoch: int, group_size: int, batch_size: int, num_iterations: int, accumulate: int, world: int
) -> None:
    """Refuse an epoch that does not split into whole groups per rank, whole micro-batches per
    rollout and whole optimizer steps (the command line checks it before the Trainer starts, the
    DataModule again at set-up with the real number of ranks)."""
    if prompts_per_epoch % world:
        raise ValueError(
            f"data.prompts_per_epoch={prompts_per_epoch} must divide evenly over the "
            f"{world} ranks (each rank samples whole groups for its own prompts)."
        )
    per_rank = prompts_per_epoch // world
    rollout = per_rank * group_size
    if rollout % batch_size:
        raise ValueError(
            f"data.batch_size={batch_size} does not divide the {rollout} completions each "
            f"rank samples per epoch (prompts_per_epoch/world_size={per_rank} "
            f"x group_size={group_size}); pick a divisor of {rollout}."
        )
    micro_batches = num_iterations * rollout // batch_size
    if micro_batches % accumulate:
        raise ValueError(
            f"trainer.accumulate_grad_batches={accumulate} does not divide the {micro_batches} micro-batches "
            f"of an epoch (data.num_iterations={num_iterations} x {rollout} completions per rank / "
            f"data.batch_size={batch_size}): every optimizer step would not see the same number of "
            f"completions; pick a divisor of {micro_batches}, or a smaller data.batch_size."
        )
