"""PPOModule: PPO with a critic, for a LoRA policy (InstructGPT-style RLHF, rule rewards).

The actor is the LoRA policy GRPO trains. By default the critic shares its
frozen base: a second LoRA adapter named ``critic`` on the same peft model
plus a value head ``Linear(hidden, 1)`` on the decoder's last hidden state,
so actor, critic and reference (every adapter disabled) cost one set of base
weights. With ``critic`` set to a :class:`~lit_grpo.model.policy.PolicySpec` the
critic is a model of its own instead (LoRA or fully fine-tuned, any causal LM
with the actor's tokenizer) under the same kind of value head: a second set
of base weights, in exchange for a critic whose features the actor's updates
do not move (and an actor whose single adapter can be merged for decoding).
One training step runs the actor pass and the critic pass and backpropagates
their summed loss (:func:`~lit_grpo.objectives.ppo_loss`) into the actor, the
critic and the head.

At rollout time the ``gae`` estimator (:mod:`lit_grpo.rollout.estimators`)
asks this module for the critic's values (:meth:`PPOModule.rollout_values`), builds per-token rewards
(the sequence reward on the last token, minus ``kl_coef`` x the k1 KL to
the reference), and stores GAE advantages (whitened over the rollout's real
tokens) and returns in the buffer.

Departures from the papers, on purpose:

* The default critic is an adapter on the actor's frozen base, not a
  separate model (InstructGPT initialises a separate critic from the reward
  model; set ``critic`` for a separate one).
* With the shared critic, rollouts decode through the adapter, never through
  the merged view (:mod:`lit_grpo.generation.merged` folds a single adapter).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from safetensors.torch import save_file
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from lit_grpo.algorithms.on_policy import SCORED_KEYS, OnPolicyModule
from lit_grpo.generation import GenerationSpec
from lit_grpo.model.adapters import active_adapter, kept_requires_grad
from lit_grpo.model.logprob_passes import completion_hidden_states, completion_logprobs
from lit_grpo.model.policy import PolicySpec, build_policy, load_tokenizer
from lit_grpo.objectives import ppo_loss
from lit_grpo.objectives.grpo import CLIP_METRICS
from lit_grpo.objectives.ppo import VALUE_METRICS
from lit_grpo.training.distributed import full_tensors, shard

ACTOR, CRITIC = "default", "critic"  # peft adapter names; CRITIC also names the critic's export folder
VALUE_HEAD_FILE = "value_head.safetensors"


class PPOModule(OnPolicyModule):
    """Proximal Policy Optimization with a LoRA actor and a critic, by default on the same frozen base.

    Args:
        policy: Which model to train and its adapter (LoRA is required for
            the shared critic, a second adapter of the same shape).
        critic: ``None``: the critic is a second LoRA adapter on the policy's
            frozen base. A :class:`~lit_grpo.model.policy.PolicySpec`: a separate
            critic model built from it (``lora: null`` fine-tunes it fully),
            which must use the policy's tokenizer. Either way a value head
            ``Linear(hidden, 1)`` reads its last hidden state.
        vf_coef: Weight of the value loss in the total loss.
        value_clip: Half-width of the clip of new values around the rollout's.
        gamma: Discount per completion token.
        lam: GAE's lambda (0: one-step TD error, 1: Monte-Carlo return).
        kl_coef: Weight of the k1 KL to the reference inside the per-token
            rewards; 0 skips the reference pass.
        whiten_advantages: Whiten the GAE advantages over the rollout's real tokens.
        epsilon_low: Lower clip range of the ratio (1 - epsilon_low).
        epsilon_high: Upper clip range of the ratio (1 + epsilon_high).
        loss_type: Aggregation of the policy term over tokens: ``bnpo`` (token
            mean per micro-batch), ``grpo`` (mean per sequence, then over
            sequences) or ``dr_grpo`` (sum / (rows x max_completion_length)).
        max_completion_length: Denominator of ``dr_grpo``; defaults to the
            DataModule's ``sampling.max_new_tokens``.
        optimizer: Optimizer factory over actor, critic and value head; ``None``
            gives AdamW with lr 1e-4 and no weight decay.
        scheduler: Optional learning-rate scheduler factory (stepped per optimizer step).
        max_nonfinite_steps: Consecutive optimizer steps with a NaN/inf
            gradient that are skipped before training stops with an error.
        log_samples: Sample completions written per epoch to ``samples.jsonl``.
        progress: Show progress bars for rollout generation.
        validate_before_training: Score the validation prompts once before the first step.
        generation: Which engine samples rollouts, see
            :class:`~lit_grpo.generation.GenerationSpec`.
    """

    ADVANTAGE_ESTIMATORS = ("gae",)
    EPISODES_REFUSED = (
        "its critic's GAE runs over every completion position, tool tokens included, and is "
        "not defined on the policy's turns alone yet; train tools with GRPOModule "
        "(data.advantage.estimator grpo, rloo or reinforce_pp)."
    )
    merges_for_generation = False  # rollouts decode through the actor adapter, see the module docstring

    def __init__(
        self,
        policy: PolicySpec | None = None,
        critic: PolicySpec | None = None,
        vf_coef: float = 0.5,
        value_clip: float = 0.2,
        gamma: float = 1.0,
        lam: float = 0.95,
        kl_coef: float = 0.0,
        whiten_advantages: bool = True,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_type: Literal["bnpo", "grpo", "dr_grpo"] = "bnpo",
        max_completion_length: int | None = None,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
        max_nonfinite_steps: int = 3,
        log_samples: int = 2,
        progress: bool = True,
        validate_before_training: bool = True,
        generation: GenerationSpec | None = None,
    ) -> None:
        if loss_type not in ("bnpo", "grpo", "dr_grpo"):  # dapo's global rescale would scale the value loss too
            raise ValueError(f"model.loss_type={loss_type!r}; expected one of ['bnpo', 'dr_grpo', 'grpo'].")
        super().__init__(policy, optimizer, scheduler, max_nonfinite_steps, generation)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        for name, value in (
            ("vf_coef", vf_coef),
            ("value_clip", value_clip),
            ("kl_coef", kl_coef),
            ("epsilon_low", epsilon_low),
            ("epsilon_high", epsilon_high),
        ):
            if not value >= 0:
                raise ValueError(f"model.{name}={value}; expected >= 0.")
        for name, value in (("gamma", gamma), ("lam", lam)):
            if not 0 <= value <= 1:
                raise ValueError(f"model.{name}={value}; expected a value in [0, 1].")
        if critic is None and self.spec.lora is None:
            raise ValueError(
                "PPOModule needs model.policy.lora for its default critic, a second LoRA adapter "
                "on the policy's frozen base; or set model.critic (a policy spec) to train a "
                "separate critic model."
            )
        if critic is not None:
            _check_same_tokenizer(critic, self.tokenizer, self.spec)
            self.merges_for_generation = True  # the actor holds a single adapter, which merges
        self.critic_spec = critic
        self.critic_model: nn.Module | None = None  # the separate critic, built in configure_model
        self.value_head: nn.Linear | None = None

    # ------------------------------------------------------------------ model
    @property
    def needs_reference(self) -> bool:
        return self.hparams.kl_coef > 0

    def estimator_options(self) -> dict[str, float]:
        """What the ``gae`` estimator reads of this objective."""
        hp = self.hparams
        return {"kl_coef": hp.kl_coef, "gamma": hp.gamma, "lam": hp.lam, "whiten_advantages": hp.whiten_advantages}

    def configure_model(self) -> None:
        """Load the policy, the critic (adapter or model) and the value head (once), then
        shard them under FSDP2 (the adapters must exist before FSDP2 wraps the layers)."""
        if self.policy is None:
            self.policy, self.reference = build_policy(self.spec, need_reference=self.needs_reference)
            if self.critic_spec is None:
                self.policy.add_adapter(CRITIC, copy.deepcopy(self.policy.peft_config[ACTOR]))
                self.policy.set_adapter(ACTOR)
                critic = self.policy
            else:
                self.critic_model, _ = build_policy(self.critic_spec, need_reference=False)
                critic = self.critic_model
            self.value_head = nn.Linear(critic.config.hidden_size, 1, device=next(critic.parameters()).device)
        super().configure_model()
        if self.device_mesh is not None:
            if self.critic_model is not None:
                shard(self.critic_model, self.device_mesh)
            if not isinstance(self.value_head, FSDPModule):
                # Its own FSDP2 unit, so that its gradients are reduced across ranks like every
                # other trainable weight's (ModelParallelStrategy reduces only what FSDP2 shards).
                fully_shard(self.value_head, mesh=self.device_mesh)
        if self.critic_spec is None:
            # Both adapters train; collected after sharding, since FSDP2 swaps in parameters of its own.
            for name, p in self.policy.named_parameters():
                if any(f"lora_{part}.{adapter}." in name for part in "AB" for adapter in (ACTOR, CRITIC)):
                    p.requires_grad_(True)  # peft leaves only the active adapter trainable

    @contextlib.contextmanager
    def _critic(self) -> Iterator[nn.Module]:
        """The separate critic model, or the policy with the critic adapter active (the actor's again on exit)."""
        if self.critic_model is not None:
            yield self.critic_model
            return
        with active_adapter(self.policy, CRITIC) as model:
            yield model

    @contextlib.contextmanager
    def reference_model(self) -> Iterator[nn.Module]:
        with kept_requires_grad(self.policy), super().reference_model() as model:
            yield model

    def trainable_parameters(self) -> list[nn.Parameter]:
        critic = self.critic_model.parameters() if self.critic_model is not None else ()
        critic_trainable = [p for p in critic if p.requires_grad]
        return super().trainable_parameters() + critic_trainable + list(self.value_head.parameters())

    def critic_values(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
        """The critic's value of the state before each completion token: ``[n, C]`` float32."""
        with self._critic() as model:
            hidden = completion_hidden_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        return self.value_head(hidden.float()).squeeze(-1)  # [n, C]

    @torch.no_grad()
    def rollout_values(self, rows: dict, batch_size: int | None = None) -> torch.Tensor:
        """Values of rollout completions under the current critic, without grad: ``[N, C]``, 0 at padding;
        ``batch_size`` rows per pass (``None``: all at once)."""
        was_training = self.training
        self.eval()
        values = self.score_rollout(
            rows, lambda **part: self.critic_values(**part) * part["completion_mask"], batch_size
        )
        self.train(was_training)
        return values

    def export_writer(self) -> Callable[[Path], None]:
        """Write the actor as :meth:`PolicyModule.export_adapter` does, and the critic beside it.

        The folder holds the actor's adapter and the tokenizer; ``critic/``
        the critic: its LoRA adapter (on the policy's base for the shared
        critic, on ``critic``'s base for a separate one; ``load_adapter`` or
        ``PeftModel.from_pretrained`` reloads it) or, fully fine-tuned, the
        whole model, plus ``value_head.safetensors`` (``weight [1, H]``,
        ``bias [1]``). FSDP2-sharded weights are gathered on every rank.
        """
        write_actor = super().export_writer()  # peft writes the shared critic's adapter to critic/ itself
        state = None
        if self.critic_model is not None and self.device_mesh is not None:
            state = full_tensors((name, p) for name, p in self.critic_model.named_parameters() if p.requires_grad)
        head = full_tensors(self.value_head.state_dict().items())

        def write(folder: Path) -> None:
            write_actor(folder)
            critic = folder / CRITIC
            if self.critic_model is not None:
                self.critic_model.save_pretrained(critic, state_dict=state)
            critic.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in head.items()}, critic / VALUE_HEAD_FILE)

        return write

    # --------------------------------------------------------------- training
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        self._log_rollout_stats(batch)
        start = time.perf_counter()
        scored = {k: batch[k] for k in SCORED_KEYS}
        logprobs, entropy = completion_logprobs(
            self.policy, **scored, temperature=batch["temperature"], with_entropy=True
        )  # [n, C]
        values = self.critic_values(**scored)  # [n, C]
        mask = batch["completion_mask"]
        result = ppo_loss(
            logprobs,
            batch.get("old_logprobs", logprobs.detach()),
            batch["advantages"],
            mask,
            values,
            batch["values"],
            batch["returns"],
            epsilon_low=hp.epsilon_low,
            epsilon_high=hp.epsilon_high,
            value_clip=hp.value_clip,
            vf_coef=hp.vf_coef,
            loss_type=hp.loss_type,
            max_completion_length=hp.max_completion_length or batch["max_new_tokens"],
        )
        self._add_time("policy_forward", time.perf_counter() - start)
        metrics = {f"train/{k}": v for k, v in result.metrics.items()}
        metrics["train/entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1)
        self._log_step(
            {name: metrics[name] for name in self._step_metric_names(True)}, result.loss.detach(), rows=mask.shape[0]
        )
        self._backward_start = time.perf_counter()
        return result.loss

    def _step_metric_names(self, kl_in_rewards: bool) -> list[str]:
        return [f"train/{k}" for k in ("policy_loss", *CLIP_METRICS, *VALUE_METRICS, "entropy")]


def _check_same_tokenizer(critic: PolicySpec, tokenizer, policy: PolicySpec) -> None:
    """Refuse a critic model whose vocabulary differs from the policy's: it reads the actor's token ids."""
    if (critic.name_or_path, critic.gguf_file) == (policy.name_or_path, policy.gguf_file):
        return
    if load_tokenizer(critic).get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"model.critic.name_or_path={critic.name_or_path!r} has another tokenizer than "
            f"model.policy.name_or_path={policy.name_or_path!r}; the critic scores the actor's token ids, so "
            "it needs the same vocabulary: pick a critic of the policy's model family."
        )
