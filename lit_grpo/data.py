"""The on-policy DataModule: every epoch is one rollout round.

``train_dataloader()`` runs once per epoch (the Trainer needs
``reload_dataloaders_every_n_epochs=1``): it takes the next prompts, samples
G completions each from the *current* policy (the LightningModule it is
attached to), scores them, turns rewards into group-relative advantages,
adds reference and old log-probs where the objective needs them, and serves
the result as micro-batches. Under DDP/FSDP every rank does this for its own
share of the prompts; a group never spans ranks.

Randomness is a pure function of ``(seed, epoch, rank)``: the sampling RNG is
re-seeded at each rollout, so a run resumed from a checkpoint regenerates
exactly the rollouts the uninterrupted run would have.
"""

from __future__ import annotations

import random
from typing import Literal

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_grpo.buffer import OnDemand, RolloutBuffer
from lit_grpo.rewards import Accuracy, Format, Reward, RewardCombiner
from lit_grpo.rollout import SamplingSpec, encode_prompts
from lit_grpo.rollout_round import collect_rollout
from lit_grpo.sources import load_rows, rename_columns


class OnPolicyDataModule(L.LightningDataModule):
    """Prompts in, scored on-policy rollouts out, regenerated every epoch.

    Args:
        source: A built-in task (``arithmetic``, ``countdown``), a local
            ``.json/.jsonl/.parquet/.csv`` file, or a hub dataset
            (``name`` or ``name:config``).
        split: Training split of a file or hub source.
        val_split: Held-out split; ``None`` holds out ``val_size`` rows of the
            training split instead (built-in tasks generate a disjoint set).
        val_size: Validation prompts.
        task_args: Options of a built-in task (e.g. ``{"digits": 2, "ops": "+"}``).
        train_size: Rows a built-in task generates for training.
        columns: Our column name -> the dataset's (``{"prompt": "question"}``).
            ``prompt`` is required; other columns reach the reward functions.
        system_prompt: Optional system message of the chat template.
        prompt_template: Format string wrapping each prompt (``{prompt}``).
        max_prompt_length: Longest prompt in tokens.
        prompt_overflow: ``error`` refuses longer prompts; ``truncate`` keeps
            their last tokens and warns.
        sampling: How completions are sampled (group size, temperature, ...).
        prompts_per_epoch: Prompts per rollout round, over all ranks.
        batch_size: Completions per micro-batch; must divide the rollout
            (``prompts_per_epoch / world_size * group_size``).
        num_iterations: Optimisation passes over each rollout (mu).
        rewards: Reward functions with their weights.
        advantage_scale: ``group`` (std of the group), ``batch`` (std of the
            rollout) or ``none`` (Dr. GRPO: no scaling).
        val_reward: Scores greedy validation answers (``val/accuracy``);
            defaults to ``Accuracy``.
        val_batch_size: Prompts per validation batch.
        repeat: Cycle through the training prompts again (reshuffled) when
            they run out; without it, running out is an error.
        dynamic_sampling: DAPO dynamic sampling: replace groups whose rewards
            are all equal (zero advantage, no signal) with fresh prompts.
        max_sampling_rounds: Most rollout rounds dynamic sampling may spend
            filling one epoch's buffer.
        seed: Seed of prompt order, task generation and sampling.
    """

    def __init__(
        self,
        source: str = "arithmetic",
        split: str = "train",
        val_split: str | None = None,
        val_size: int = 64,
        task_args: dict | None = None,
        train_size: int = 2000,
        columns: dict[str, str] | None = None,
        system_prompt: str | None = None,
        prompt_template: str = "{prompt}",
        max_prompt_length: int | None = 256,
        prompt_overflow: Literal["error", "truncate"] = "error",
        sampling: SamplingSpec | None = None,
        prompts_per_epoch: int = 4,
        batch_size: int = 32,
        num_iterations: int = 1,
        rewards: list[Reward] | None = None,
        advantage_scale: Literal["group", "batch", "none"] = "group",
        val_reward: Reward | None = None,
        val_batch_size: int = 64,
        repeat: bool = True,
        dynamic_sampling: bool = False,
        max_sampling_rounds: int = 4,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["rewards", "val_reward", "sampling"])
        self.sampling = sampling or SamplingSpec()
        self.rewards = RewardCombiner(rewards if rewards is not None else [Accuracy(), Format()])
        self.val_reward = val_reward or Accuracy()
        for name, value in (("prompts_per_epoch", prompts_per_epoch), ("batch_size", batch_size),
                            ("num_iterations", num_iterations), ("val_size", val_size)):
            if value < 1:
                raise ValueError(f"data.{name}={value}; expected >= 1.")
        if "{prompt}" not in prompt_template:
            raise ValueError(f"data.prompt_template={prompt_template!r} must contain '{{prompt}}'.")
        self.position = 0  # next unused prompt in the current pass
        self.passes = 0  # completed passes over the training prompts
        self.rollout_epoch = -1  # last epoch whose rollout consumed prompts
        self.train_rows: list[dict] = []
        self.val_rows: list[dict] = []
        self.last_stats: dict[str, float] = {}
        self.last_samples: list[tuple[str, str, float]] = []

    # ----------------------------------------------------------------- set-up
    def setup(self, stage: str | None = None) -> None:
        if self.train_rows:
            return
        hp = self.hparams
        columns = hp.columns or {}
        raw = load_rows(hp.source, hp.split, hp.task_args, hp.seed, hp.train_size + hp.val_size)
        rows = rename_columns(raw, columns, hp.source)
        if hp.val_split is not None:
            val = rename_columns(load_rows(hp.source, hp.val_split, None, hp.seed, None), columns, hp.source)
            self.train_rows, self.val_rows = rows, val[: hp.val_size]
        else:
            if len(rows) <= hp.val_size:
                raise ValueError(
                    f"data.source={hp.source!r} has {len(rows)} rows, not enough to hold out "
                    f"data.val_size={hp.val_size} for validation and still train."
                )
            self.train_rows, self.val_rows = rows[hp.val_size :], rows[: hp.val_size]
        self._check_prompt_budget()
        self.rewards.check_columns(list(self.train_rows[0]), hp.source)
        RewardCombiner([self.val_reward]).check_columns(list(self.val_rows[0]), hp.source)
        self._check_prompts()

    def _check_prompts(self) -> None:
        """Chat-format and tokenize every prompt once now, so that a prompt that is too
        long (or a tokenizer without a chat template) fails before any sampling, not
        in the epoch that first draws it."""
        module = self.trainer.lightning_module if self.trainer else None
        if getattr(module, "tokenizer", None) is None:
            return
        rows = self.train_rows + self.val_rows
        for start in range(0, len(rows), 512):
            self.encode(rows[start : start + 512])

    @property
    def prompts_per_rank(self) -> int:
        """Prompts each rank samples per epoch (whole groups never span ranks)."""
        return self.hparams.prompts_per_epoch // (self.trainer.world_size if self.trainer else 1)

    def _check_prompt_budget(self) -> None:
        hp = self.hparams
        world = self.trainer.world_size if self.trainer else 1
        if hp.prompts_per_epoch % world:
            raise ValueError(
                f"data.prompts_per_epoch={hp.prompts_per_epoch} must divide evenly over the "
                f"{world} ranks (each rank samples whole groups for its own prompts)."
            )
        rollout = self.prompts_per_rank * self.sampling.group_size
        if rollout % hp.batch_size:
            raise ValueError(
                f"data.batch_size={hp.batch_size} does not divide the {rollout} completions each "
                f"rank samples per epoch (prompts_per_epoch/world_size={self.prompts_per_rank} "
                f"x group_size={self.sampling.group_size}); pick a divisor of {rollout}."
            )
        if not hp.repeat and hp.prompts_per_epoch > len(self.train_rows):
            raise ValueError(
                f"data.prompts_per_epoch={hp.prompts_per_epoch} exceeds the {len(self.train_rows)} "
                "training prompts; set data.repeat=true to cycle through them."
            )

    # ---------------------------------------------------------------- prompts
    def format_prompts(self, rows: list[dict]) -> list[str]:
        """Apply the prompt template and the tokenizer's chat template."""
        return chat_prompts(self.trainer.lightning_module.tokenizer, [row["prompt"] for row in rows],
                            self.hparams.system_prompt, self.hparams.prompt_template)

    def encode(self, rows: list[dict]):
        """Chat-format and tokenize prompts: ``(ids [B, P], mask [B, P])``."""
        tokenizer = self.trainer.lightning_module.tokenizer
        return encode_prompts(tokenizer, self.format_prompts(rows), self.hparams.max_prompt_length,
                              self.hparams.prompt_overflow)

    def next_prompts(self, count: int) -> list[dict]:
        """The next ``count`` training prompts (all ranks), reshuffled each pass."""
        taken: list[dict] = []
        while len(taken) < count:
            order = list(range(len(self.train_rows)))
            random.Random(self.hparams.seed * 1_000_003 + self.passes).shuffle(order)
            need = count - len(taken)
            chunk = order[self.position : self.position + need]
            taken += [self.train_rows[i] for i in chunk]
            self.position += len(chunk)
            if self.position >= len(order):
                if not self.hparams.repeat and len(taken) < count:
                    raise ValueError(
                        f"ran out of training prompts after {self.passes + 1} pass(es); "
                        "set data.repeat=true to cycle through them again."
                    )
                self.position, self.passes = 0, self.passes + 1
        return taken

    # ---------------------------------------------------------------- loaders
    def train_dataloader(self) -> DataLoader:
        # The rollout runs when the loader is first iterated, not here: Lightning
        # may ask for a loader it never iterates (on resume it asks once for the
        # finished epoch and once for the next), and the epoch number is only
        # right at iteration time.
        rows = self.prompts_per_rank * self.sampling.group_size
        batches = self.hparams.num_iterations * rows // self.hparams.batch_size
        return DataLoader(OnDemand(self.rollout_buffer, batches), batch_size=None)

    def rollout_buffer(self) -> RolloutBuffer | None:
        """Run this epoch's rollout round and wrap it as micro-batches.

        Returns ``None`` for an epoch whose rollout already ran and was trained
        on: a run resumed from an end-of-epoch checkpoint first peeks at the
        finished epoch's loader, and must not consume prompts for it again.
        """
        trainer = self.trainer
        if trainer.current_epoch <= self.rollout_epoch:
            return None
        self.rollout_epoch = trainer.current_epoch
        module = trainer.lightning_module
        rank = trainer.global_rank
        seed = hash((self.hparams.seed, trainer.current_epoch, rank)) % 2**31
        torch.manual_seed(seed)  # sampling and dropout of this epoch follow from (seed, epoch, rank)
        result = collect_rollout(self, module, rank)
        self.last_stats, self.last_samples = result.stats, result.samples
        return RolloutBuffer(
            result.rows,
            batch_size=self.hparams.batch_size,
            num_iterations=self.hparams.num_iterations,
            accumulate=trainer.accumulate_grad_batches,
            generator=torch.Generator().manual_seed(seed),
            token_counts=lambda t: trainer.strategy.reduce(t, reduce_op="sum"),
            temperature=self.sampling.temperature,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_rows, batch_size=self.hparams.val_batch_size, collate_fn=self.collate_val)

    def collate_val(self, rows: list[dict]) -> dict:
        """Tokenize validation rows: ``{prompt_ids, prompt_mask, rows}``."""
        prompt_ids, prompt_mask = self.encode(rows)
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "rows": rows}

    def score_validation(self, rows: list[dict], completions: list[str]) -> torch.Tensor:
        """Score greedy validation answers with ``val_reward``: ``[B]`` floats."""
        columns = columns_of(rows)
        prompts = columns.pop("prompt")
        values = self.val_reward(prompts, completions, **columns)
        return torch.tensor([0.0 if v is None else float(v) for v in values])

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {"position": self.position, "passes": self.passes, "rollout_epoch": self.rollout_epoch}

    def load_state_dict(self, state_dict: dict) -> None:
        self.position, self.passes = state_dict["position"], state_dict["passes"]
        self.rollout_epoch = state_dict.get("rollout_epoch", -1)


def chat_prompts(tokenizer, prompts: list[str], system_prompt: str | None, prompt_template: str) -> list[str]:
    """Wrap each prompt in ``prompt_template`` and the tokenizer's chat template.

    Raises:
        ValueError: The tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template, which the prompts need; use an instruct/chat "
            "model or set tokenizer.chat_template."
        )
    texts = []
    for prompt in prompts:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt_template.format(prompt=prompt)})
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return texts


def columns_of(rows: list[dict]) -> dict[str, list]:
    """Rows -> columns (``{name: [value per row]}``)."""
    return {key: [row.get(key) for row in rows] for key in rows[0]}
