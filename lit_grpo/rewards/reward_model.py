"""A trained reward model as a reward: a scalar score of prompt + completion.

:class:`RewardModel` scores each (prompt, completion) through the reward
model's own chat template (the conversation ``[system?, user: prompt,
assistant: completion]``), in batches, without gradients, on the policy's
device; it sits in ``data.rewards`` beside rule rewards, with its weight.
Two ways to hold it:

* a separate sequence-classification model (``shared_base: false``): any
  folder or hub id ``AutoModelForSequenceClassification`` loads with one
  output, e.g. what ``lit-grpo rm fit --export_adapter DIR`` wrote to ``DIR``;
* a second LoRA adapter plus its head on the policy's own frozen base
  (``shared_base: true``, ``DIR/adapter`` of that export): actor, reference,
  PPO's critic and the reward model then share one copy of the base weights.
  The adapter must have been trained on the same base (``name_or_path`` and
  ``init_adapter``) and with the same vocabulary. Several reward models can
  share the base: each loads as an adapter of its own (``rm_<name>``).

The score of a row is the head on the last hidden state of its rightmost
token that is not padding, the rule transformers' sequence-classification
models apply, so both ways (and the model ``rm fit`` trains) score alike.
Under DDP/FSDP each rank scores the rows it sampled.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_grpo.model.logprob_passes import final_hidden_states
from lit_grpo.model.sources import CONFIG, MODEL_FOLDER_FILES, WEIGHTS, hub_offline
from lit_grpo.model.stream import keep_stream_fp32
from lit_grpo.rewards.base import Reward

ADAPTER_DIR = "adapter"  # where rm fit's export keeps adapter + head, beside the full model
HEAD_FILE = "reward_head.safetensors"  # weight [1, H]
BASE_FILE = "lit_grpo_base.json"  # the base the adapter was trained on: name_or_path, init_adapter
ADAPTER_FILES = ("adapter_config.json", HEAD_FILE, BASE_FILE)  # what shared_base=true loads
# What name_or_path may be, said by every refusal of a path that is no model.
EXPECTED = (
    "expected a folder written by lit-grpo rm fit --export_adapter or, with shared_base=false, a "
    "sequence-classification model folder or hub id (org/name)."
)


def conversation_texts(tokenizer, prompts: list[str], replies: list[str], system_prompt: str | None) -> list[str]:
    """Each (prompt, reply) as the chat template renders ``[system?, user, assistant]``.

    Raises:
        ValueError: The tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the reward model's tokenizer has no chat template, which scoring prompt + completion "
            "needs; use a chat reward model or set tokenizer.chat_template in its folder."
        )
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [
        tokenizer.apply_chat_template(
            [*system, {"role": "user", "content": p}, {"role": "assistant", "content": r}], tokenize=False
        )
        for p, r in zip(prompts, replies)
    ]


def encode_conversations(
    tokenizer, prompts: list[str], replies: list[str], system_prompt: str | None, max_length: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize conversations right-padded: ``(input_ids [N, T], attention_mask [N, T])``.

    Longer rows keep their last ``max_length`` tokens (the reply's end is what is scored).
    """
    rows = tokenizer(conversation_texts(tokenizer, prompts, replies, system_prompt), add_special_tokens=False)[
        "input_ids"
    ]
    if max_length is not None:
        rows = [r[-max_length:] for r in rows]
    width, pad = max(map(len, rows)), tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])  # [N, T]
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])  # [N, T]
    return ids, mask


def last_token_index(input_ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """``[N]`` index of each row's rightmost token that is not ``pad_token_id`` (the last when ``None``):
    transformers' pooling rule for sequence classification, left or right padding."""
    if pad_token_id is None:
        return torch.full(input_ids.shape[:1], input_ids.shape[1] - 1, device=input_ids.device)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # [T]
    return (positions * (input_ids != pad_token_id)).argmax(-1)  # [N]


def backbone_scores(
    model: nn.Module, head: nn.Linear, input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int | None
) -> torch.Tensor:
    """``[N]`` float32 scores: ``head`` on the decoder's last hidden state at :func:`last_token_index`.

    ``model`` is a causal LM or a peft model around one; its active adapters apply.
    """
    hidden = final_hidden_states(
        model, input_ids=input_ids, attention_mask=attention_mask, use_cache=False
    )  # [N, T, H]
    last = hidden[torch.arange(len(hidden), device=hidden.device), last_token_index(input_ids, pad_token_id)]
    return head(last.to(head.weight.dtype)).squeeze(-1).float()  # [N]


class RewardModel(Reward):
    """A sequence-classification reward model, separate or on the policy's base (see the module docstring).

    Args:
        name_or_path: A local folder or hub id of a sequence-classification
            model with one output, or the folder ``lit-grpo rm fit
            --export_adapter`` wrote (its ``adapter/`` holds adapter + head).
        weight: Multiplier of this reward in the total.
        name: Key in logs; default ``reward_model``.
        shared_base: Run the reward model as a second adapter + head on the
            policy's frozen base instead of a model of its own.
        normalize: Standardise the scores of each batch (zero mean, unit std).
        batch_size: Rows per scoring pass.
        system_prompt: System message of the scored conversations (use the
            one the reward model was trained with).
        max_length: Longest scored conversation in tokens (longer ones keep their end).
        dtype: Weight dtype of a separate reward model.
    """

    default_name = "reward_model"

    def __init__(
        self,
        name_or_path: str,
        weight: float = 1.0,
        name: str | None = None,
        shared_base: bool = False,
        normalize: bool = False,
        batch_size: int = 16,
        system_prompt: str | None = None,
        max_length: int | None = 1024,
        dtype: str = "float32",
    ) -> None:
        super().__init__(weight, name)
        folder = reward_model_folder(name_or_path, shared_base)  # before anything loads
        from transformers import AutoTokenizer

        from lit_grpo.model.policy import DTYPES

        if batch_size < 1:
            raise ValueError(f"RewardModel batch_size={batch_size}; expected >= 1.")
        if dtype not in DTYPES:
            raise ValueError(f"RewardModel dtype={dtype!r}; expected one of {sorted(DTYPES)}.")
        self.name_or_path, self.shared_base, self.normalize = name_or_path, shared_base, normalize
        self.batch_size, self.system_prompt, self.max_length = batch_size, system_prompt, max_length
        self.dtype = DTYPES[dtype]
        self.folder = folder if shared_base else _check_classifier(folder)
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        conversation_texts(self.tokenizer, ["?"], ["!"], None)  # no chat template: fail now, not mid-rollout
        self.module = None  # the training module, see bind()
        self.model: nn.Module | None = None  # the separate model, or the policy carrying the adapter
        self.head: nn.Linear | None = None  # the head on the shared base
        # its peft adapter's name on the policy's base: one per reward, so several reward models can share it
        self.adapter_name = "rm_" + re.sub(r"\W", "_", self.name)

    def bind(self, module) -> None:
        """Score on ``module``'s policy's device (and, with ``shared_base``, on the policy itself), loading now.

        Called by :meth:`RewardCombiner.bind` once the policy is built, before
        FSDP2 shards it; a second call for the same module does nothing.
        """
        if self.module is module and self.model is not None:
            return
        self.module = module
        if self.shared_base:
            self.model, self.head = _shared_adapter(self.folder, self.adapter_name, module, self.tokenizer)
            return
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(
            self.folder, dtype=self.dtype, use_kernels=False
        )  # as the policy's
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = keep_stream_fp32(model).requires_grad_(False).eval()

    @torch.no_grad()
    def scores(self, prompts: list[str], completions: list[str]) -> torch.Tensor:
        """``[N]`` float32 scores on the CPU, before normalisation."""
        if self.model is None:
            raise RuntimeError(
                f"RewardModel {self.name!r} was never bound to a policy (RewardCombiner.bind); "
                "GRPO modules bind their DataModule's rewards when they load the policy."
            )
        device = self._follow_the_policy()
        show = getattr(self.module, "show_progress", None)  # an on-policy module's bar (or line) for the pass
        bar = show(f"reward model {self.name}", len(prompts), "completion") if show else None
        out = []
        try:
            for start in range(0, len(prompts), self.batch_size):
                ids, mask = encode_conversations(
                    self.tokenizer,
                    prompts[start : start + self.batch_size],
                    completions[start : start + self.batch_size],
                    self.system_prompt,
                    self.max_length,
                )
                out.append(self._score(ids.to(device), mask.to(device)).cpu())
                if bar is not None:
                    bar.update(len(out[-1]))
        finally:
            if bar is not None:
                bar.close()
        return torch.cat(out)  # [N]

    def _follow_the_policy(self) -> torch.device:
        """Move what scores to the policy's device (the strategy moves the policy after binding)."""
        device = next(self.module.policy.parameters()).device
        for part in (self.model, self.head):
            if part is not None and next(part.parameters()).device != device:
                part.to(device)
        return device

    def _score(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if not self.shared_base:
            return self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
        from lit_grpo.model.adapters import active_adapter

        was_training = self.model.training
        self.model.eval()
        try:
            with active_adapter(self.model, self.adapter_name) as model:
                return backbone_scores(model, self.head, ids, mask, self.tokenizer.pad_token_id)
        finally:
            self.model.train(was_training)

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        values = self.scores(prompts, completions)  # [N]
        if self.normalize and len(values) > 1:
            values = (values - values.mean()) / (values.std() + 1e-6)
        return values.tolist()


def _check_classifier(name_or_path: str) -> str:
    """Refuse, before training, a model that is not a one-output sequence classifier."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path)  # a local folder, or a hub id the hub may lack
    except OSError as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise FileNotFoundError(
            f"RewardModel name_or_path={name_or_path!r} could not be loaded ({reason}); {EXPECTED}"
        ) from error
    kinds = config.architectures or []
    if not any(kind.endswith("ForSequenceClassification") for kind in kinds):
        raise ValueError(
            f"RewardModel name_or_path={name_or_path!r} is a {kinds or 'model of no named architecture'}, not a "
            "sequence-classification model; pass what lit-grpo rm fit --export_adapter wrote, or another "
            "AutoModelForSequenceClassification folder or hub id."
        )
    if config.num_labels != 1:
        raise ValueError(
            f"RewardModel name_or_path={name_or_path!r} has a head with {config.num_labels} outputs; "
            "a reward model needs exactly one (num_labels=1)."
        )
    return name_or_path


def reward_model_folder(name_or_path: str, shared_base: bool) -> str:
    """What :class:`RewardModel` loads from ``name_or_path``: with ``shared_base`` the adapter + head
    folder of an ``rm fit`` export (its ``adapter/``, or that folder itself), else the model folder or hub id.

    The one check of both ways, before anything loads. The local path is looked at first: a folder
    that does not exist or holds no model fails at once, with the same message either way; only a
    name shaped like a hub id (``org/name``, with ``shared_base=false``) is looked up, in the hub's cache.

    Raises:
        FileNotFoundError: ``name_or_path`` is no folder, holds no model, or not the part the
            ``shared_base`` way loads.
    """
    path = Path(name_or_path)
    if not path.exists():
        if not shared_base and _hub_id(name_or_path):
            if _hub_model_may_load(name_or_path):
                return name_or_path
            problem = (
                ": no such folder, and the model hub is not reachable (offline) with no copy of that hub id "
                "in its cache"
            )
        else:
            problem = ": no such folder"
    elif not path.is_dir():
        problem = " is a file, not a folder"
    else:
        adapter = path / ADAPTER_DIR if (path / ADAPTER_DIR).is_dir() else path
        adapter_missing = [f for f in ADAPTER_FILES if not (adapter / f).is_file()]
        model_missing = [
            what
            for what in (CONFIG, WEIGHTS)
            if not any(next(path.glob(pattern), None) for pattern in MODEL_FOLDER_FILES[what])
        ]
        if shared_base and not adapter_missing:
            return str(adapter)
        if not shared_base and not model_missing:
            return name_or_path
        if model_missing and not (adapter / "adapter_config.json").is_file():  # neither way's
            problem = f" is not a model folder: it has no {' and no '.join(model_missing)}, and no adapter_config.json"
        elif shared_base:
            raise FileNotFoundError(
                f"RewardModel name_or_path={name_or_path!r} with shared_base=true has no {adapter_missing[0]} "
                f"(looked in {str(adapter)!r}); pass the folder lit-grpo rm fit --export_adapter wrote, trained "
                "with LoRA."
            )
        else:
            raise FileNotFoundError(
                f"RewardModel name_or_path={name_or_path!r} holds no whole model, only an adapter in "
                f"{str(adapter)!r}; load it onto the policy's base with shared_base=true, or pass a "
                "sequence-classification model folder."
            )
    raise FileNotFoundError(f"RewardModel name_or_path={name_or_path!r}{problem}; {EXPECTED}")


def _hub_id(name: str) -> bool:
    """Whether ``name`` has the shape of a hub model id, ``org/name`` (a local path may have it too)."""
    return re.fullmatch(r"[\w-][\w.-]*/[\w-][\w.-]*", name) is not None


def _hub_model_may_load(name: str) -> bool:
    """Whether the hub's cache holds model ``name``, or the hub answers (which then says); nothing is downloaded."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, "config.json"), str) or not hub_offline()


def _shared_adapter(folder: str, adapter_name: str, module, tokenizer) -> tuple[nn.Module, nn.Linear]:
    """Load the reward adapter (frozen) onto ``module.policy`` as ``adapter_name``, its head on the policy's device."""
    from safetensors.torch import load_file

    from lit_grpo.model.adapters import kept_requires_grad

    spec, policy = module.spec, module.policy
    if spec.lora is None:
        raise ValueError(
            "RewardModel shared_base=true needs model.policy.lora: the reward model is a second "
            "adapter on the policy's frozen base; set shared_base=false for a full fine-tuned policy."
        )
    if tokenizer.get_vocab() != module.tokenizer.get_vocab():
        raise ValueError(
            f"RewardModel name_or_path={folder!r} has another vocabulary than model.policy.name_or_path="
            f"{spec.name_or_path!r}; shared_base=true needs a reward model trained on the policy's base "
            "(or set shared_base=false)."
        )
    base = json.loads((Path(folder) / BASE_FILE).read_text())
    for field in ("name_or_path", "init_adapter"):
        ours = getattr(spec, field)
        if not _same_path(base.get(field), ours):
            raise ValueError(
                f"RewardModel name_or_path={folder!r} was trained on policy.{field}={base.get(field)!r}, "
                f"this policy has {ours!r}; with shared_base=true both must be the same base (train the "
                "reward model with this policy's settings, or set shared_base=false)."
            )
    if adapter_name not in policy.peft_config:
        was_training = policy.training
        with kept_requires_grad(policy):
            policy.load_adapter(folder, adapter_name=adapter_name, is_trainable=False)
        policy.train(was_training)  # peft puts the whole model in eval mode when it loads a frozen adapter
    weight = load_file(Path(folder) / HEAD_FILE)["weight"]  # [1, H]
    device = next(policy.parameters()).device
    head = nn.Linear(weight.shape[1], 1, bias=False, device=device, dtype=weight.dtype).requires_grad_(False)
    head.weight.data.copy_(weight)
    return policy, head


def _same_path(a: str | None, b: str | None) -> bool:
    if a == b:
        return True
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)
