"""The groups of :class:`~lit_grpo.data.grpo.OnPolicyDataModule`'s settings, one per question a
run answers: where the prompts come from (``data.source``), which are held out and how they are
scored (``data.held_out``), how a prompt is written (``data.prompt``) and how rewards become
advantages (``data.advantage``). Sampling (``data.sampling``) and episodes (``data.episodes``)
are groups of their own. Each checks its fields when it is built and names them as a config does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from lit_grpo.data.sources import InMemory, in_memory
from lit_grpo.rewards import Reward


@dataclass
class SourceSpec:
    """Where the training prompts come from (``data.source``).

    Args:
        dataset: A built-in task (``arithmetic``, ``countdown``, ``word_problems``,
            ``reasoning_gym``), a local ``.json/.jsonl/.parquet/.csv`` file, or a hub
            dataset (``name`` or ``name:config``); in Python also the rows themselves: a
            list of dicts, a ``datasets.Dataset`` or ``DatasetDict`` (TRL's
            ``train_dataset``). A prompt is text or a conversation (a list of
            ``{role, content}`` messages).
        split: Training split of a file or hub dataset.
        task_args: Options of a built-in task (e.g. ``{"digits": 2, "ops": "+"}``), or a
            list of them: a mix, each set generating an equal share of the rows
            (``[{"digits": 2}, {"digits": [2, 3]}]``).
        train_size: Rows a built-in task generates for training.
        columns: Our column name -> the dataset's (``{"prompt": "question"}``).
            ``prompt`` is required; other columns reach the reward functions.
    """

    dataset: str | Any = "arithmetic"
    split: str = "train"
    task_args: dict | list[dict] | None = None
    train_size: int = 2000
    columns: dict[str, str] | None = None
    rows: str | InMemory = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.rows = in_memory(self.dataset)  # a name or path; or rows handed over in Python
        if self.train_size < 1:
            raise ValueError(f"data.source.train_size={self.train_size}; expected >= 1.")

    @property
    def label(self) -> str:
        """The dataset as messages name it: its name or path, or what the rows handed over are."""
        return self.rows if isinstance(self.rows, str) else repr(self.rows)


@dataclass
class HeldOutSpec:
    """The held-out prompts, scored by greedy answers before, during and after training
    (``data.held_out``).

    Args:
        split: Held-out split of a file or hub dataset; ``None`` holds out ``size`` rows of
            the training split instead (built-in tasks generate a disjoint set).
        size: Held-out prompts (and prompts per slice of ``slices``).
        slices: Further held-out sets of a built-in task, each scored like the held-out
            prompts and logged as ``val/<name>/accuracy``: name -> task options that
            override ``data.source.task_args`` (``{"3+2": {"digits": [3, 2]}}``: questions
            the training distribution does not cover; the first set of a mix is
            overridden). Prompts also in training are dropped.
        reward: Scores greedy answers (``val/accuracy``); defaults to ``Accuracy``. In Python
            also a reward function, as ``data.rewards`` takes (e.g. one that reads
            ``environments``).
        batch_size: Prompts per validation batch.
    """

    split: str | None = None
    size: int = 64
    slices: dict[str, dict] | None = None
    reward: Reward | None = None
    batch_size: int = 64

    def __post_init__(self) -> None:
        for name in ("size", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.held_out.{name}={getattr(self, name)}; expected >= 1.")


@dataclass
class PromptSpec:
    """How a row's prompt becomes the text the policy continues (``data.prompt``).

    Args:
        system_prompt: Optional system message of the chat template.
        template: Format string wrapping each prompt (``{prompt}``).
        completion_prefix: Text the assistant's reply starts with, put after the chat
            template (``<think>`` opens the reasoning, as R1-Zero's template does): the
            policy continues from it, and the rewards, validation and the samples file
            read it in front of each completion.
        max_length: Longest prompt in tokens.
        overflow: ``error`` refuses longer prompts; ``truncate`` keeps their last tokens
            and warns.
    """

    system_prompt: str | None = None
    template: str = "{prompt}"
    completion_prefix: str = ""
    max_length: int | None = 256
    overflow: Literal["error", "truncate"] = "error"

    def __post_init__(self) -> None:
        if "{prompt}" not in self.template:
            raise ValueError(f"data.prompt.template={self.template!r} must contain '{{prompt}}'.")
        if self.overflow not in ("error", "truncate"):
            raise ValueError(f"data.prompt.overflow={self.overflow!r}; expected error or truncate.")


@dataclass
class AdvantageSpec:
    """How a rollout's rewards become advantages (``data.advantage``).

    Args:
        estimator: ``grpo`` (group-normalised), ``rloo`` (leave one out),
            ``reinforce_pp`` (REINFORCE++: per token, batch-whitened returns with the
            module's ``beta`` x KL in the rewards) or ``gae`` (per token, from the module's
            critic: PPOModule); ``None`` takes the module's first choice (``grpo`` for
            GRPOModule, ``gae`` for PPOModule). ``grpo`` and ``rloo`` need group_size >= 2.
        scale: ``group`` (std of the group), ``batch`` (std of the rollout) or ``none``
            (Dr. GRPO: no scaling); read by ``grpo`` only.
        multi_objective_aggregation: With several rewards, ``sum_then_normalize``
            normalises their weighted total in its group; ``normalize_then_sum`` (GDPO)
            normalises each reward in its group, sums them with their weights and scales
            the sum by its std over the rollout, so a reward with a large spread does not
            drown the others. Read by ``grpo`` only.
    """

    estimator: Literal["grpo", "rloo", "reinforce_pp", "gae"] | None = None
    scale: Literal["group", "batch", "none"] = "group"
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"

    def __post_init__(self) -> None:
        if self.scale not in ("group", "batch", "none"):
            raise ValueError(f"data.advantage.scale={self.scale!r}; expected group, batch or none.")
        if self.multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
            raise ValueError(
                f"data.advantage.multi_objective_aggregation={self.multi_objective_aggregation!r}; "
                "expected sum_then_normalize or normalize_then_sum."
            )
        if self.multi_objective_aggregation == "normalize_then_sum" and self.estimator not in (None, "grpo"):
            raise ValueError(
                f"data.advantage.multi_objective_aggregation='normalize_then_sum' with data.advantage."
                f"estimator={self.estimator!r}; it normalises each reward in its group: use grpo."
            )
