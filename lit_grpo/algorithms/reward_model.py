"""RewardModelModule: a Bradley-Terry reward model, a LoRA adapter plus a scalar head on the base.

RLHF's second stage (InstructGPT): learn a score ``r(prompt, reply)`` from
preference pairs with ``-log sigmoid(r(chosen) - r(rejected))``
(:func:`lit_grpo.objectives.bradley_terry_loss`). The score is a bias-free
``Linear(hidden, 1)`` head on the decoder's last hidden state at the
conversation's last token that is not padding
(:func:`lit_grpo.rewards.reward_model.backbone_scores`), the rule of
transformers' sequence-classification models, so the export below scores
exactly as training did. The head has no bias because the loss only sees
differences of scores. ``suffix_weight`` adds the same loss at every token from
a pair's first differing one (:func:`pair_loss`). Loading, (Q)LoRA or full
fine-tuning, the optimizer, checkpoints and strategies come from
:class:`~lit_grpo.algorithms.base.PolicyModule`.

Validation: the pairwise accuracy on held-out pairs (chosen scored higher)
and the mean reward margin. ``--export_adapter DIR`` writes ``DIR`` as a
transformers sequence-classification model (adapter merged,
``AutoModelForSequenceClassification.from_pretrained(DIR)`` loads it) and,
with LoRA, ``DIR/adapter`` as adapter + head, which
:class:`~lit_grpo.rewards.RewardModel` with ``shared_base: true`` loads onto
a policy's own base.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from safetensors.torch import save_file
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from lit_grpo.algorithms.supervised import SupervisedModule
from lit_grpo.generation.merged import merged_weights
from lit_grpo.model.logprob_passes import cache_rows, final_hidden_states
from lit_grpo.model.policy import PolicySpec, build_policy
from lit_grpo.objectives import LossOutput, bradley_terry_loss
from lit_grpo.rewards.reward_model import ADAPTER_DIR, BASE_FILE, HEAD_FILE, backbone_scores
from lit_grpo.training.distributed import full_tensors, gathered


class RewardModelModule(SupervisedModule):
    """Bradley-Terry reward model: the policy's base, a LoRA adapter and a scalar head.

    Args:
        policy: The base model, its adapter (``lora: null`` fine-tunes it
            fully), quantization and dtype. ``init_adapter`` folds an SFT
            adapter into the base first, so that the reward model can later
            share the base of a policy started from that adapter.
        optimizer: Optimizer factory over adapter and head; ``None`` gives
            AdamW with lr 1e-4 and no weight decay.
        scheduler: Optional learning-rate scheduler factory (stepped per optimizer step).
        max_nonfinite_steps: Consecutive optimizer steps with a NaN/inf
            gradient that are skipped before training stops with an error.
        progress: Print the validation metrics before training and after each validation.
        head_lr: Learning rate of the scalar head, a parameter group of its own
            (a scheduler that scales every group's rate, such as cosine
            annealing, keeps the ratio); ``None``: the optimizer's rate.
        suffix_weight: Weight of a second Bradley-Terry loss on the head's scores at
            every token from a pair's first differing one (the chosen reply's n-th
            token of its own against the rejected one's n-th), added to the loss on
            the conversations' scores: "the reply has gone wrong" is taught where it
            happens, a short path through the network, rather than only at the last
            token. The score, the validation accuracy and the export stay the last
            token's; ``0``: that loss alone (InstructGPT's, TRL's).
        suffix_stages: The ``data.curriculum`` stages (their indices) whose training batches add the
            ``suffix_weight`` loss; the others train the last token's loss alone (validation
            always adds it). ``None``: every batch.
    """

    shown_metrics = ("val/loss", "val/accuracy", "val/margin")
    pair_accuracy = "accuracy"

    def __init__(
        self,
        policy: PolicySpec | None = None,
        optimizer: OptimizerCallable | None = None,
        scheduler: LRSchedulerCallable | None = None,
        max_nonfinite_steps: int = 3,
        progress: bool = True,
        head_lr: float | None = None,
        suffix_weight: float = 0.0,
        suffix_stages: list[int] | None = None,
    ) -> None:
        super().__init__(policy, optimizer, scheduler, max_nonfinite_steps)
        if head_lr is not None and not head_lr > 0:
            raise ValueError(f"model.head_lr={head_lr!r}; expected a learning rate > 0, or null for the optimizer's.")
        if not suffix_weight >= 0:
            raise ValueError(f"model.suffix_weight={suffix_weight!r}; expected a weight >= 0 (0: the last token only).")
        if suffix_stages is not None and not (
            isinstance(suffix_stages, list) and all(type(i) is int and i >= 0 for i in suffix_stages)
        ):
            raise ValueError(
                f"model.suffix_stages={suffix_stages!r}; expected a list of data.curriculum stage "
                "indices (0 is the first stage), or null for every batch."
            )
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.reward_head: nn.Linear | None = None

    def configure_model(self) -> None:
        """Load the base with its adapter and the head (once); shard both under FSDP2."""
        if self.policy is None:
            self.policy, _ = build_policy(self.spec, need_reference=False)
            device = next(self.policy.parameters()).device
            self.reward_head = nn.Linear(self.policy.config.hidden_size, 1, bias=False, device=device)
        super().configure_model()
        if self.device_mesh is not None and not isinstance(self.reward_head, FSDPModule):
            fully_shard(self.reward_head, mesh=self.device_mesh)  # its gradients reduced across ranks too

    def trainable_parameters(self) -> list[nn.Parameter]:
        return super().trainable_parameters() + list(self.reward_head.parameters())

    def optimizer_groups(self) -> list:
        if self.hparams.head_lr is None:
            return self.trainable_parameters()
        return [
            {"params": super().trainable_parameters()},
            {"params": list(self.reward_head.parameters()), "lr": self.hparams.head_lr},
        ]

    def scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[N]`` float32 reward of each conversation."""
        return backbone_scores(self.policy, self.reward_head, input_ids, attention_mask, self.tokenizer.pad_token_id)

    def batch_loss(self, batch: dict) -> LossOutput:
        every, lengths = suffix_scores(
            self.policy, self.reward_head, batch["input_ids"], batch["attention_mask"], self.tokenizer.pad_token_id
        )  # [2B, S], [2B]: each pair's prefix run once
        return pair_loss(every, lengths, self.suffix_weight())

    def suffix_weight(self) -> float:
        """The ``suffix_weight`` of the batch being trained or validated (``suffix_stages``)."""
        stages = self.hparams.suffix_stages
        if stages is None or not self.training:
            return self.hparams.suffix_weight
        return self.hparams.suffix_weight if self.trainer.datamodule.batch_stage() in stages else 0.0

    def on_fit_start(self) -> None:
        super().on_fit_start()
        stages = self.hparams.suffix_stages
        curriculum = getattr(self.trainer.datamodule, "curriculum", None)
        count = len(curriculum.stages) if curriculum is not None else 0
        if stages is not None and max(stages, default=0) >= count:
            have = f"{count} stages" if count else "no data.curriculum"
            raise ValueError(f"model.suffix_stages={stages!r} names curriculum stages, and the data have {have}.")
        super().on_fit_start()

    def batch_rows(self, batch: dict) -> int:
        return batch["input_ids"].shape[0] // 2  # pairs

    # ----------------------------------------------------------------- export
    def export_writer(self) -> Callable[[Path], None]:
        """Write the folder as a sequence-classification model and, with LoRA, ``adapter/`` in it as
        adapter + head (see the module docstring); :meth:`export_adapter` writes it atomically.
        FSDP2-sharded weights are gathered on every rank, and rank 0 builds the classifier from them."""
        head = full_tensors(self.reward_head.state_dict().items())
        write_adapter = super().export_writer() if self.spec.lora is not None else None
        classifier = None
        if self.spec.load_in_4bit:
            warnings.warn(
                f"the sequence-classification export needs unquantized weights (these are 4-bit), so "
                f"only {ADAPTER_DIR}/ is written: adapter + head, which RewardModel(shared_base=true) "
                "loads.",
                stacklevel=2,
            )
        else:
            with gathered(self.policy):  # whole weights on every rank for a moment (a collective)
                if self.global_rank == 0:
                    classifier = self.classifier(head["weight"])

        def write(folder: Path) -> None:
            if write_adapter is not None:
                adapter = folder / ADAPTER_DIR
                adapter.mkdir()
                write_adapter(adapter)
                save_file({k: v.contiguous() for k, v in head.items()}, adapter / HEAD_FILE)
                base = {
                    "name_or_path": self.spec.name_or_path,
                    "init_adapter": self.spec.init_adapter,
                    "policy": dataclasses.asdict(self.spec),
                }
                (adapter / BASE_FILE).write_text(json.dumps(base, indent=2))
            if classifier is not None:
                classifier.save_pretrained(folder)
                self.tokenizer.save_pretrained(folder)

        return write

    @torch.no_grad()
    def classifier(self, head_weight: torch.Tensor) -> nn.Module:
        """A transformers sequence-classification model with the adapter merged and this head."""
        from transformers import AutoModelForSequenceClassification

        base = self.policy.get_base_model() if self.spec.lora is not None else self.policy
        config = copy.deepcopy(base.config)
        config.num_labels, config.pad_token_id, config.architectures = 1, self.tokenizer.pad_token_id, None
        model = AutoModelForSequenceClassification.from_config(config, dtype=self.spec.torch_dtype)
        prefix = model.base_model_prefix + "."
        weights = {k[len(prefix) :]: v.cpu() for k, v in merged_weights(self.policy).items() if k.startswith(prefix)}
        missing, _ = getattr(model, model.base_model_prefix).load_state_dict(weights, strict=False)
        if missing:
            raise ValueError(
                f"cannot export the reward model as {type(model).__name__}: its backbone has weights "
                f"the policy lacks, e.g. {missing[0]}; use the adapter + head export instead."
            )
        score = getattr(model, "score", None)
        if not isinstance(score, nn.Linear) or score.weight.shape != head_weight.shape:
            raise ValueError(
                f"cannot export the reward model as {type(model).__name__}: it has no one-output "
                "'score' head; use the adapter + head export instead."
            )
        score.weight.copy_(head_weight.to(score.weight.dtype))
        return model


def pair_scores(
    model: nn.Module, head: nn.Linear, input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int | None
) -> torch.Tensor:
    """:func:`~lit_grpo.rewards.reward_model.backbone_scores` of B pairs, the tokens rows share run once.

    ``input_ids``/``attention_mask`` ``[2B, T]`` are right-padded conversations, chosen first
    (:class:`~lit_grpo.data.reward_pairs.RewardDataModule`); the scores are the last of
    :func:`suffix_scores`.
    """
    return _last_scores(*suffix_scores(model, head, input_ids, attention_mask, pad_token_id))


def pair_loss(every: torch.Tensor, lengths: torch.Tensor, suffix_weight: float = 0.0) -> LossOutput:
    """The Bradley-Terry loss of B pairs from their :func:`suffix_scores` ``[2B, S]`` and ``[2B]``, chosen first.

    With ``suffix_weight`` > 0 it adds that times the loss of every token both replies have from
    their first difference, the chosen reply's n-th against the rejected one's n-th
    (``RewardModelModule(suffix_weight=)``); its accuracy is the metric ``suffix_accuracy``.
    """
    result = bradley_terry_loss(*_last_scores(every, lengths).chunk(2))  # the conversations' scores
    if not suffix_weight:
        return result
    (chosen, rejected), (chosen_lengths, rejected_lengths) = every.chunk(2), lengths.chunk(2)  # [B, S], [B]
    both = torch.arange(every.shape[1], device=every.device) < torch.minimum(chosen_lengths, rejected_lengths)[:, None]
    tokens = bradley_terry_loss(chosen[both], rejected[both])  # [B, S] -> the tokens both replies have
    return LossOutput(
        loss=result.loss + suffix_weight * tokens.loss,
        metrics={**result.metrics, "suffix_accuracy": tokens.metrics["accuracy"]},
    )


def _last_scores(every: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[N]`` the conversations' scores: each row's last of :func:`suffix_scores`' ``[N, S]``."""
    return every[torch.arange(len(every), device=every.device), lengths - 1]


def suffix_scores(
    model: nn.Module, head: nn.Linear, input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's score at every token of each row from its pair's first differing token on.

    A pair's conversations agree up to the reply's first differing token (system prompt,
    question, most of the reply), and all the batch's conversations agree on their first tokens
    (the system prompt, the question's first words). So the batch's common prefix runs once,
    each pair's further shared tokens once per pair (left-padded after it), and only the two
    suffixes run on that key/value cache (gradients sum back through it): the scores equal one
    full pass per row, for about a third of the token passes on the arithmetic pairs. A
    checkpointed model takes the full pass (transformers drops the cache of a layer it
    checkpoints), and so does one sharded by FSDP2, which gathers a layer's weights again for
    backward only where gradient reaches that call's output: the prefix passes' only output
    is their cache.

    Returns:
        ``([2B, S] float32 scores, [2B] suffix lengths)``: row ``i``'s scores at offsets ``>=
        lengths[i]`` are padding; its score at ``lengths[i] - 1`` is its conversation's score
        (the last token that is not padding).
    """
    from lit_grpo.model.kv_cache import with_cache

    B = len(input_ids) // 2
    lengths = attention_mask.sum(-1)  # [2B]
    same = (input_ids[:B] == input_ids[B:]) & attention_mask[:B].bool() & attention_mask[B:].bool()  # [B, T]
    shared = same.int().cumprod(-1).sum(-1)  # [B] common prefix length
    shared = torch.minimum(shared, torch.minimum(lengths[:B], lengths[B:]) - 1).clamp(min=0)  # each keeps a token
    rows = torch.arange(2 * B, device=input_ids.device) % B  # the pair of each row
    suffix_lengths = lengths - shared[rows]  # [2B], >= 1
    offsets = torch.arange(int(suffix_lengths.max()), device=input_ids.device)  # [S]
    source = (shared[rows][:, None] + offsets).clamp(max=input_ids.shape[1] - 1)  # [2B, S]
    suffix_mask = (offsets < suffix_lengths[:, None]).long()  # [2B, S]
    full_pass = any(
        getattr(m, "gradient_checkpointing", False) is True or isinstance(m, FSDPModule) for m in model.modules()
    )
    if full_pass or int(shared.max()) == 0:
        hidden = final_hidden_states(model, input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = hidden.gather(1, source[..., None].expand(-1, -1, hidden.shape[-1]))  # [2B, S, H]
    else:
        pad = pad_token_id if pad_token_id is not None else 0
        cache, prefix_mask = _prefix_cache(model, input_ids, attention_mask, shared, pad)  # [B, P] mask
        suffix_ids = input_ids.gather(1, source).masked_fill(suffix_mask == 0, pad)  # [2B, S]
        hidden = final_hidden_states(
            model,
            input_ids=suffix_ids,
            attention_mask=torch.cat([prefix_mask[rows], suffix_mask], dim=1),
            position_ids=shared[rows][:, None] + offsets,
            **with_cache(cache_rows(cache, rows)),
            use_cache=True,
        )  # [2B, S, H]
    return head(hidden.to(head.weight.dtype)).squeeze(-1).float(), suffix_lengths


def _prefix_cache(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, shared: torch.Tensor, pad: int
):
    """The key/value cache of each pair's first ``shared`` tokens, ``[B, P]`` rows, and its mask.

    The first ``C`` tokens, which every conversation shares, run once and are repeated for the B
    pairs; each pair's remaining ``shared - C`` tokens run after them, left-padded to ``P - C``.
    """
    from transformers import DynamicCache

    from lit_grpo.model.kv_cache import with_cache

    B, device = len(shared), input_ids.device
    agree = ((input_ids == input_ids[:1]) & attention_mask.bool()).int().cumprod(-1).sum(-1)  # [2B]
    C, P = min(int(agree.min()), int(shared.min())), int(shared.max())
    cache = DynamicCache()
    if C > 0:
        final_hidden_states(
            model,
            input_ids=input_ids[:1, :C],
            attention_mask=attention_mask[:1, :C],
            position_ids=torch.arange(C, device=device)[None],
            **with_cache(cache),
            use_cache=True,
        )
        one = torch.zeros(B, dtype=torch.long, device=device)
        for layer in cache.layers:  # the batch's prefix for every pair; its gradients sum back (index_add_)
            layer.keys, layer.values = layer.keys.index_select(0, one), layer.values.index_select(0, one)
    column = torch.arange(P - C, device=device) - (P - shared)[:, None]  # [B, P - C] offset past C, < 0: padding
    mask = torch.cat([attention_mask[:B, :C], (column >= 0).long()], dim=1)  # [B, P]
    if P > C:
        ids = input_ids[:B].gather(1, (C + column).clamp(min=0)).masked_fill(column < 0, pad)  # [B, P - C]
        final_hidden_states(
            model,
            input_ids=ids,
            attention_mask=mask,
            position_ids=C + (mask[:, C:].cumsum(-1) - 1).clamp(min=0),
            **with_cache(cache),
            use_cache=True,
        )
    return cache, mask
