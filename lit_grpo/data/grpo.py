"""The on-policy DataModule: every epoch is one rollout round.

``train_dataloader()`` runs once per epoch (the Trainer needs
``reload_dataloaders_every_n_epochs=1``). When its loader is first read, the
DataModule hands the epoch's next prompts to its
:class:`~lit_grpo.rollout.producer.RolloutProducer`, which samples G
completions each from the *current* policy (the LightningModule it is
attached to), scores them, adds reference and old log-probs where the
objective needs them and turns rewards into advantages
(``data.advantage``); the DataModule serves the scored rollout as
micro-batches. Under DDP/FSDP every rank does this for its own share of the
prompts; a group never spans ranks. docs/design.md draws the whole step.

Randomness is a pure function of ``(seed, epoch, rank)``: the sampling RNG is
re-seeded at each rollout (and the global RNG at each micro-batch), so a run
resumed from an end-of-epoch checkpoint regenerates exactly the rollouts the
uninterrupted run would have. A checkpoint saved inside an epoch carries that
epoch's rollout (every rank's), and the resumed run trains on the micro-batches
that were still to come.
"""

from __future__ import annotations

import math
import random

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_grpo.data.batches import BatchCursor
from lit_grpo.data.buffer import OnDemand, RolloutBuffer
from lit_grpo.data.episodes import EpisodeSetup, EpisodesSpec
from lit_grpo.data.held_out import HeldOutPrompts
from lit_grpo.data.prompts import chat_prompts, check_prompt_lengths
from lit_grpo.data.sampled_ahead import SamplesAhead
from lit_grpo.data.setup_checks import check_prompt_budget, choose_estimator
from lit_grpo.data.sources import GROUPED, check_slices, held_out_slices, load_rows, rename_columns, split_rows
from lit_grpo.data.specs import AdvantageSpec, HeldOutSpec, PromptSpec, SourceSpec
from lit_grpo.data.tasks import TooFewQuestions
from lit_grpo.generation.rollout import SamplingSpec, encode_prompts
from lit_grpo.rewards import Accuracy, Format, Reward, RewardCombiner, TrainerState
from lit_grpo.rollout.ahead import SamplingAhead
from lit_grpo.rollout.producer import RolloutProducer, ScoredRollout
from lit_grpo.training.distributed import gather_to_rank_zero
from lit_grpo.training.preemption import Preempted, abortable


class OnPolicyDataModule(SamplesAhead, HeldOutPrompts, L.LightningDataModule):
    """Prompts in, scored on-policy rollouts out, regenerated every epoch.

    Args:
        source: Where the prompts come from (:class:`~lit_grpo.data.specs.SourceSpec`: the
            dataset, its split and columns, a built-in task's options).
        held_out: The held-out prompts and their scoring (:class:`~lit_grpo.data.specs.HeldOutSpec`).
        prompt: How a prompt is written: system prompt, template, completion prefix,
            length (:class:`~lit_grpo.data.specs.PromptSpec`).
        sampling: How completions are sampled (group size, temperature, ...).
        episodes: Tools and a multi-turn environment (:class:`~lit_grpo.data.episodes.EpisodesSpec`):
            with either, every completion is an episode (:mod:`lit_grpo.data.episodes`).
        rewards: Reward functions with their weights.
        advantage: How rewards become advantages (:class:`~lit_grpo.data.specs.AdvantageSpec`).
        prompts_per_epoch: Prompts per rollout round, over all ranks.
        batch_size: Completions per micro-batch; must divide the rollout
            (``prompts_per_epoch / world_size * group_size``).
        num_iterations: Optimisation passes over each rollout (mu).
        repeat: Cycle through the training prompts again (reshuffled) when
            they run out; without it, running out is an error.
        dynamic_sampling: DAPO dynamic sampling: replace groups whose rewards
            are all equal (zero advantage, no signal) with fresh prompts.
        max_sampling_rounds: Most rollout rounds dynamic sampling may spend
            filling one epoch's buffer.
        oversampling: With dynamic sampling, each round samples this many times the
            epoch's prompts and trains on the first groups with signal, so that a further
            round is rarely needed (DAPO samples 3x) and under ``staleness`` the whole
            rollout is sampled ahead of training. The groups beyond what the epoch needs
            are dropped, their prompts used for this pass over the data.
        staleness: How many rollouts sampling may run ahead of training: 0
            (default) samples each epoch's rollout with the current weights; k
            samples epoch n+k's in a background thread, with the weights as
            they are at epoch n, while epoch n trains (one-step-off at 1; see
            :mod:`lit_grpo.rollout.ahead`). The loss then corrects for the older
            sampler with truncated importance sampling. Dynamic sampling's
            further rounds are sampled when the rollout is taken, by the
            current weights.
        seed: Seed of prompt order, task generation and sampling.
    """

    def __init__(
        self,
        source: SourceSpec | None = None,
        held_out: HeldOutSpec | None = None,
        prompt: PromptSpec | None = None,
        sampling: SamplingSpec | None = None,
        episodes: EpisodesSpec | None = None,
        rewards: list[Reward] | None = None,
        advantage: AdvantageSpec | None = None,
        prompts_per_epoch: int = 4,
        batch_size: int = 32,
        num_iterations: int = 1,
        repeat: bool = True,
        dynamic_sampling: bool = False,
        max_sampling_rounds: int = 4,
        oversampling: float = 1.0,
        staleness: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(
            ignore=["source", "held_out", "prompt", "sampling", "episodes", "rewards", "advantage"]
        )
        self.source = source or SourceSpec()
        self.held_out = held_out or HeldOutSpec()
        self.prompt = prompt or PromptSpec()
        self.sampling = sampling or SamplingSpec()
        self.advantage = advantage or AdvantageSpec()
        rewards = rewards if rewards is not None else [Accuracy(), Format()]
        self.val_reward = self.held_out.reward or Accuracy()
        self.val_scorer = RewardCombiner([self.val_reward])
        for name, value in (
            ("prompts_per_epoch", prompts_per_epoch),
            ("batch_size", batch_size),
            ("num_iterations", num_iterations),
        ):
            if value < 1:
                raise ValueError(f"data.{name}={value}; expected >= 1.")
        if not oversampling >= 1:
            raise ValueError(f"data.oversampling={oversampling}; expected >= 1 (1: the epoch's prompts, no more).")
        if oversampling > 1 and not dynamic_sampling:
            raise ValueError(
                f"data.oversampling={oversampling} needs data.dynamic_sampling: true (it samples spare groups "
                "for the ones whose rewards are all equal); set it to 1."
            )
        if staleness < 0:
            raise ValueError(
                f"data.staleness={staleness}; expected >= 0 (0: sample with the current weights, "
                "k: up to k rollouts ahead of training)."
            )
        check_slices(self.source.label, self.held_out.slices or {})
        self.position = 0  # next unused prompt in the current pass
        self.passes = 0  # completed passes over the training prompts
        self.rollout_epoch = -1  # last epoch whose rollout consumed prompts
        self.train_rows: list[dict] = []
        self.val_rows: list[dict] = []
        self.val_slices: dict[str, list[dict]] = {}  # name -> rows
        self.last_result: ScoredRollout | None = None  # this epoch's rollout
        self.cursor = BatchCursor(seed)  # the epoch's micro-batches started so far; every seed
        self.producer: RolloutProducer | None = None  # built in setup, once the estimator is known
        self.restored: dict | None = None  # a rollout restored from a checkpoint saved inside its epoch
        self.ahead: SamplingAhead | None = None  # data.staleness > 0: the rollouts sampling ahead
        self.pending: list[dict] = []  # rollouts to sample ahead again, restored from a checkpoint
        self.advantage_estimator = self.advantage.estimator or "grpo"  # resolved against the module in setup
        self.episodes_spec = episodes or EpisodesSpec()
        self.episodes = None  # tools / an environment: every completion is an episode
        if self.episodes_spec.active:
            spec = self.episodes_spec
            cap = spec.max_episode_tokens or 2 * self.sampling.max_new_tokens
            if cap < self.sampling.max_new_tokens:
                raise ValueError(
                    f"data.episodes.max_episode_tokens={cap} < sampling.max_new_tokens="
                    f"{self.sampling.max_new_tokens}; expected a cap on the whole episode."
                )
            self.episodes = EpisodeSetup(spec, cap)
        self.rewards = (
            RewardCombiner(rewards)
            if self.episodes is None
            else self.episodes.rewards(rewards, self.episodes_spec.environment_reward_weight)
        )

    # ----------------------------------------------------------------- set-up
    def setup(self, stage: str | None = None) -> None:
        if self.train_rows:
            return
        source, held_out, seed = self.source, self.held_out, self.hparams.seed
        self.train_rows, self.val_rows = split_rows(
            self._load, source.label, source.split, held_out.split, source.train_size, held_out.size, GROUPED
        )
        self.val_slices = held_out_slices(
            source.label,
            held_out.slices or {},
            source.task_args,
            source.columns or {},
            seed,
            held_out.size,
            self.train_rows + self.val_rows,
        )
        choose_estimator(self)  # first: a group size the estimator refuses also breaks the budget
        check_prompt_budget(self)
        self.rewards.check_columns(list(self.train_rows[0]), source.label)
        for rows in self.val_sets().values():
            self.val_scorer.check_columns(list(rows[0]), source.label)
        check_prompt_lengths(self)
        if self.episodes is not None:
            self.episodes.check(self.train_rows + self.val_rows)
        hp = self.hparams
        self.producer = RolloutProducer(
            self.sampling,
            self.rewards,
            self.advantage_estimator,
            self._encode_for_rollout,
            self.full_completions,
            advantage_scale=self.advantage.scale,
            batch_size=hp.batch_size,
            num_iterations=hp.num_iterations,
            dynamic_sampling=hp.dynamic_sampling,
            max_sampling_rounds=hp.max_sampling_rounds,
            multi_objective_aggregation=self.advantage.multi_objective_aggregation,
        )

    def _load(self, split: str, size: int) -> list[dict]:
        source = self.source
        try:
            raw = load_rows(source.rows, split, source.task_args, self.hparams.seed, size, GROUPED)
        except TooFewQuestions as error:
            raise ValueError(
                f"data.source.train_size={source.train_size} + data.held_out.size={self.held_out.size} rows "
                f"asked of data.source.dataset={source.label!r}: {error} Lower data.source.train_size, or "
                "widen data.source.task_args (more digits or ops)."
            ) from None
        return rename_columns(raw, source.columns or {}, source.label, fields=GROUPED)

    @property
    def prompts_per_rank(self) -> int:
        """Prompts each rank samples per epoch (whole groups never span ranks)."""
        return self.hparams.prompts_per_epoch // (self.trainer.world_size if self.trainer else 1)

    # ---------------------------------------------------------------- prompts
    def format_prompts(self, rows: list[dict]) -> list[str]:
        """Apply the prompt template and the tokenizer's chat template, then the completion prefix."""
        if self.episodes is not None:  # the tools described, an environment's reset text added
            return self.episodes.prompts(self, rows)
        texts = chat_prompts(
            self.trainer.lightning_module.tokenizer,
            [row["prompt"] for row in rows],
            self.prompt.system_prompt,
            self.prompt.template,
        )
        return [text + self.prompt.completion_prefix for text in texts]

    def full_completions(self, completions: list[str]) -> list[str]:
        """Sampled completions as the reply reads: the completion prefix in front of each
        (an episode's final answer has it already where it belongs)."""
        if self.episodes is not None:
            return list(completions)
        return [self.prompt.completion_prefix + text for text in completions]

    def encode(self, rows: list[dict]):
        """Chat-format and tokenize prompts: ``(ids [B, P], mask [B, P])``."""
        tokenizer = self.trainer.lightning_module.tokenizer
        return encode_prompts(tokenizer, self.format_prompts(rows), self.prompt.max_length, self.prompt.overflow)

    def _encode_for_rollout(self, rows: list[dict], repeat: int):
        """``(prompt_ids, prompt_mask, episodes, environments)`` of rows sampled ``repeat`` times each."""
        if self.episodes is not None:
            return self.episodes.start(self, rows, repeat)
        return (*self.encode(rows), None, None)

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
    @property
    def micro_batches(self) -> int:
        """Micro-batches per epoch on each rank (``num_iterations`` passes over the rollout)."""
        return self.hparams.num_iterations * self.prompts_per_rank * self.sampling.group_size // self.hparams.batch_size

    def train_dataloader(self) -> DataLoader:
        # The rollout runs when the loader is first iterated, not here: Lightning
        # may ask for a loader it never iterates (on resume it asks once for the
        # finished epoch and once for the next), and the epoch number is only
        # right at iteration time.
        return DataLoader(OnDemand(self.rollout_buffer, self.micro_batches), batch_size=None)

    def rollout_buffer(self) -> RolloutBuffer | None:
        """Run this epoch's rollout round and wrap it as micro-batches.

        A run resumed from a checkpoint saved inside this epoch gets the
        epoch's rollout back from the checkpoint instead, and its buffer starts
        after the micro-batches already trained on. Returns ``None`` for an
        epoch whose rollout already ran and was trained on: a run resumed from
        an end-of-epoch checkpoint first peeks at the finished epoch's loader,
        and must not consume prompts for it again.
        """
        trainer = self.trainer
        epoch, rank = trainer.current_epoch, trainer.global_rank
        restored, self.restored = self.restored, None
        start = 0
        if restored is not None and restored["epoch"] == epoch:
            result, start = ScoredRollout(**restored["ranks"][rank]), restored["trained"]
            if self.hparams.staleness:
                self._start_ahead()
        elif epoch <= self.rollout_epoch:
            return None
        else:
            before = self.position, self.passes, self.rollout_epoch
            # the rollouts sampling ahead before this call, a checkpoint's pending ones included
            launched = {saved["epoch"] for saved in self.pending} | set(self.ahead.jobs if self.ahead else ())
            self.rollout_epoch = epoch
            try:
                # One process may abandon its rollout on SIGTERM; ranks must finish theirs (see preemption).
                with abortable(trainer.world_size == 1):
                    if self.hparams.staleness:
                        result = self._produce_ahead(epoch, rank)
                    else:
                        torch.manual_seed(self.cursor.seed_of(epoch, rank))  # sampling follows from (seed, epoch, rank)
                        result = self._produce(rank)
            except Preempted:  # give the prompts back: the checkpoint is the state before this rollout
                self.position, self.passes, self.rollout_epoch = before
                if self.ahead is not None:
                    self.ahead.drop(set(self.ahead.jobs) - launched)
                raise
        self.last_result = result
        self.cursor.epoch, self.cursor.trained = epoch, start
        return RolloutBuffer(
            result,
            batch_size=self.hparams.batch_size,
            num_iterations=self.hparams.num_iterations,
            accumulate=trainer.accumulate_grad_batches,
            generator=torch.Generator().manual_seed(self.cursor.seed_of(epoch, rank)),
            token_counts=lambda t: trainer.strategy.reduce(t, reduce_op="sum"),
            every_batch={
                "temperature": self.sampling.temperature,
                "max_new_tokens": self.sampling.max_new_tokens,
                "kl_in_rewards": self.producer.kl_in_rewards,
                "sampled_ahead": self.hparams.staleness > 0,
            },
            start=start,
        )

    def _produce(self, rank: int, **sampled_ahead) -> ScoredRollout:
        """This rank's rollout of the epoch, from the module the DataModule is attached to
        (``sampled_ahead``: :meth:`RolloutProducer.produce`'s ``first``, ``generator`` and ``stats``)."""
        trainer = self.trainer

        def missing_on_any_rank(missing: int) -> bool:
            return bool(trainer.strategy.reduce(torch.tensor(float(missing)), reduce_op="sum") > 0)

        return self.producer.produce(
            lambda: self._my_prompts(rank),
            trainer.lightning_module,
            count=self.prompts_per_rank,
            missing_on_any_rank=missing_on_any_rank,
            accumulate=trainer.accumulate_grad_batches,
            epoch=trainer.current_epoch,
            trainer_state=self.trainer_state(),
            **sampled_ahead,
        )

    def trainer_state(self) -> TrainerState:
        """Where training is, as the rewards that read ``trainer_state`` see it."""
        trainer = self.trainer
        steps_per_epoch = -(-self.micro_batches // trainer.accumulate_grad_batches)
        max_steps = trainer.max_steps
        if max_steps < 0 and trainer.max_epochs is not None and trainer.max_epochs >= 0:
            max_steps = trainer.max_epochs * steps_per_epoch
        return TrainerState(trainer.global_step, trainer.current_epoch, max_steps)

    def _my_prompts(self, rank: int) -> list[dict]:
        """This rank's prompts of one sampling round: its share of the epoch's, ``data.oversampling`` times."""
        local = math.ceil(round(self.prompts_per_rank * self.hparams.oversampling, 9))  # 50 x 1.1 is 55, not 56
        world = self.trainer.world_size if self.trainer else 1
        return self.next_prompts(local * world)[rank * local : (rank + 1) * local]

    @property
    def last_stats(self) -> dict[str, float]:
        """The latest rollout's statistics (reward, lengths, timings, ...)."""
        return self.last_result.stats if self.last_result else {}

    def begin_batch(self, index: int) -> None:
        """Micro-batch ``index`` of the epoch's rollout starts training.

        Seeds the global RNG (dropout) from ``(seed, epoch, rank, index)``, so
        a run resumed inside an epoch trains each remaining micro-batch with
        the same random numbers as the uninterrupted run, and records the
        position a checkpoint saved after this micro-batch resumes from. Both
        use the buffer's own count: after some resumes Lightning's batch index
        restarts at 0 inside an epoch.
        """
        self.cursor.begin(self.trainer.global_rank, index)

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Prompt position, and inside an epoch that epoch's rollout (every rank's).

        Called on every rank when a checkpoint is saved, so it gathers the
        rollouts of all ranks into the one checkpoint rank 0 writes (a collective).
        """
        state = {"position": self.position, "passes": self.passes, "rollout_epoch": self.rollout_epoch}
        trainer = self.trainer
        if self.last_result is not None and 0 < self.cursor.trained < self.micro_batches:
            state["rollout"] = {
                "epoch": self.rollout_epoch,
                "trained": self.cursor.trained,
                "ranks": gather_to_rank_zero(vars(self.last_result), trainer.world_size),
            }
        if self.hparams.staleness:  # the rollouts sampling ahead: their prompts and frozen weights
            state["pending"] = self._pending_state()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self.position, self.passes = state_dict["position"], state_dict["passes"]
        self.rollout_epoch = state_dict.get("rollout_epoch", -1)
        self.restored = state_dict.get("rollout")
        self.pending = state_dict.get("pending", [])
        world = self.trainer.world_size if self.trainer else 1
        if self.restored is not None and len(self.restored["ranks"]) != world:
            raise ValueError(
                f"the checkpoint was saved inside epoch {self.restored['epoch']} by "
                f"{len(self.restored['ranks'])} process(es) and holds their rollouts; resume it with "
                f"trainer.devices x num_nodes = {len(self.restored['ranks'])} (now {world}), or from an "
                "end-of-epoch checkpoint."
            )
