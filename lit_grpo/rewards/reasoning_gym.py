"""reasoning-gym's own scorers as a reward: each row scored by its task's ``score_answer``.

Rows from ``data.source.dataset: reasoning_gym`` carry ``answer`` and ``metadata``
(which names the task); the answer scored is the text of the completion's last
``<answer>…</answer>`` (reasoning-gym's format), an ``<answer>`` left open
running to the end of its line, or else the completion's last non-empty line;
an answer written as an equation (``6 + 7 = 13``, ``m = 62``) counts as its
right-hand side.
"""

from __future__ import annotations

import re
from typing import Any

from lit_grpo.rewards.base import Reward

_CLOSED = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_OPEN = re.compile(r"<answer>\s?([^\n<]*)")


def extract_answer(completion: str) -> str:
    """The answer a completion gives (see the module docstring)."""
    closed, opened = _CLOSED.findall(completion), _OPEN.findall(completion)
    if closed:
        answer = closed[-1]
    elif opened:
        answer = opened[-1]
    else:
        lines = [line for line in completion.splitlines() if line.strip()]
        answer = lines[-1] if lines else ""
    return answer.rpartition("=")[2].strip()


def reasoning_gym_score(
    prompts: list, completions: list[str], answer: list[str], metadata: list[dict], **columns: Any
) -> list[float]:
    """Each completion's score by its row's reasoning-gym task (0.0 to 1.0; partial credit where the
    task gives it)."""
    import reasoning_gym

    scores = []
    for prompt, completion, right, meta in zip(prompts, completions, answer, metadata):
        score = reasoning_gym.get_score_answer_fn(meta["source_dataset"])
        entry = {"question": prompt, "answer": right, "metadata": meta}
        scores.append(float(score(answer=extract_answer(completion), entry=entry)))
    return scores


class ReasoningGym(Reward):
    """reasoning-gym's scorer as a weighted reward (``data.source.dataset: reasoning_gym``).

    Args:
        weight: Multiplier of this reward in the total.
        name: Key in logs.
    """

    default_name = "reasoning_gym"
    required_columns = ("answer", "metadata")

    def __call__(self, prompts: list, completions: list[str], **columns: Any) -> list[float | None]:
        return reasoning_gym_score(prompts, completions, **columns)
