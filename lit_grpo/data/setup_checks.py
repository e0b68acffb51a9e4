"""Set-up checks of the on-policy DataModule: the advantage estimator against the module and the
group size, and the prompt budget against ranks and micro-batches (before any sampling)."""

from __future__ import annotations

from lit_grpo.rollout.estimators import ESTIMATORS


def choose_estimator(data) -> None:
    """Resolve ``advantage_estimator`` against what the module can train with, and its group size."""
    module = data.trainer.lightning_module if data.trainer else None
    accepted = getattr(module, "ADVANTAGE_ESTIMATORS", ("grpo", "rloo"))
    name = data.hparams.advantage_estimator or accepted[0]
    if name not in ESTIMATORS or name not in accepted:
        owner = type(module).__name__ if module is not None else "GRPOModule"
        raise ValueError(
            f"data.advantage_estimator={name!r}; {owner} trains with one of "
            f"{list(accepted)} (or null for {accepted[0]!r})."
        )
    G = data.sampling.group_size
    if ESTIMATORS[name].needs_group and G < 2:
        raise ValueError(
            f"sampling.group_size={G}; expected >= 2 with data.advantage_estimator={name!r} (its baseline "
            "comes from the other completions of the same prompt); sample more per prompt, or train a "
            "critic (PPOModule, advantage_estimator 'gae'), which works with 1."
        )
    if data.hparams.dynamic_sampling and G < 2:
        raise ValueError(f"data.dynamic_sampling=true needs sampling.group_size >= 2, got {G}.")
    data.advantage_estimator = name


def check_prompt_budget(data) -> None:
    """Refuse prompts that do not split over the ranks, micro-batches that do not divide a rollout."""
    hp = data.hparams
    world = data.trainer.world_size if data.trainer else 1
    if hp.prompts_per_epoch % world:
        raise ValueError(
            f"data.prompts_per_epoch={hp.prompts_per_epoch} must divide evenly over the "
            f"{world} ranks (each rank samples whole groups for its own prompts)."
        )
    rollout = data.prompts_per_rank * data.sampling.group_size
    if rollout % hp.batch_size:
        raise ValueError(
            f"data.batch_size={hp.batch_size} does not divide the {rollout} completions each "
            f"rank samples per epoch (prompts_per_epoch/world_size={data.prompts_per_rank} "
            f"x group_size={data.sampling.group_size}); pick a divisor of {rollout}."
        )
    if not hp.repeat and hp.prompts_per_epoch > len(data.train_rows):
        raise ValueError(
            f"data.prompts_per_epoch={hp.prompts_per_epoch} exceeds the {len(data.train_rows)} "
            "training prompts; set data.repeat=true to cycle through them."
        )
