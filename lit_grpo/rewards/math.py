"""Rule rewards for reasoning tasks: DeepSeek-R1's three, plus DAPO's length shaping.

* ``accuracy`` (R1): the final answer equals the reference, judged by
  math-verify (``0.5`` == ``1/2``, ``1,000`` == ``1000``), not a string match.
* ``format`` (R1): ``<think>…</think><answer>…</answer>`` and nothing else.
* ``language_consistency`` (R1 scores the share of target-language words; we
  give 1 only when every letter is in the target script, 0 otherwise).
* ``overlong_penalty`` (DAPO's soft overlong punishment).
"""

from __future__ import annotations

import re
import threading
import unicodedata
from typing import Any

from math_verify import parse, verify

from lit_grpo.rewards.base import Reward

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_TAG = r"</?(?:think|answer)>"
# The body of a tag may not contain another think/answer tag.
_BODY = rf"(?:(?!{_TAG}).)*"
_FORMAT = re.compile(rf"\s*<think>{_BODY}</think>\s*<answer>{_BODY}</answer>\s*", re.DOTALL)
_SCRIPTS = {
    "latin": ("LATIN",),
    "cjk": ("CJK", "HIRAGANA", "KATAKANA", "HANGUL"),
    "cyrillic": ("CYRILLIC",),
    "greek": ("GREEK",),
    "arabic": ("ARABIC",),
    "hebrew": ("HEBREW",),
    "devanagari": ("DEVANAGARI",),
}
# Markup is not language: tags and LaTeX commands are skipped when checking the script.
_MARKUP = re.compile(r"</?[A-Za-z_]+>|\\[A-Za-z]+")


def extract_answer(completion: str) -> str | None:
    """The final answer: the last ``<answer>`` body, else the last ``\\boxed{}``, else the last number."""
    tagged = _ANSWER.findall(completion)
    if tagged:
        return tagged[-1].strip()
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unbalanced braces


def _parse(text: str) -> list:
    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    parsed = parse(text, parsing_timeout=timeout)
    return parsed or parse(f"${text}$", parsing_timeout=timeout)


def _is_correct(completion: str, answer: Any) -> float:
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    gold, guess = _parse(str(answer)), _parse(predicted)
    if not gold or not guess:
        return 0.0
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    return float(verify(gold, guess, timeout_seconds=timeout))


def accuracy(prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
    """1.0 where the completion's final answer is equivalent to the row's ``answer``.

    Rows whose ``answer`` is None are not applicable (None).
    """
    answers = _column("accuracy", columns, "answer")
    return [None if a is None else _is_correct(c, a) for c, a in zip(completions, answers)]


def format(prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:  # noqa: A001
    """1.0 where the whole completion is ``<think>…</think>`` then ``<answer>…</answer>``."""
    return [float(_FORMAT.fullmatch(c) is not None) for c in completions]


def language_consistency(
    prompts: list[str], completions: list[str], script: str = "latin", **columns: Any
) -> list[float | None]:
    """1.0 where every letter outside markup belongs to ``script`` (also when there are none)."""
    prefixes = _script_prefixes(script)

    def consistent(text: str) -> bool:
        letters = (ch for ch in _MARKUP.sub(" ", text) if ch.isalpha())
        return all(unicodedata.name(ch, "").startswith(prefixes) for ch in letters)

    return [float(consistent(c)) for c in completions]


def overlong_penalty(
    prompts: list[str],
    completions: list[str],
    max_len: int = 1024,
    buffer: int = 256,
    **columns: Any,
) -> list[float | None]:
    """DAPO soft overlong punishment from the ``completion_length`` column.

    0 up to ``max_len - buffer`` tokens, then linearly down to -1 at ``max_len`` (and beyond).
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong_penalty needs 0 < buffer <= max_len, got {buffer=}, {max_len=}")
    lengths = _column("overlong_penalty", columns, "completion_length")
    start = max_len - buffer
    return [-min(max(int(n) - start, 0) / buffer, 1.0) for n in lengths]


def _script_prefixes(script: str) -> tuple[str, ...]:
    if script not in _SCRIPTS:
        raise ValueError(f"Unknown script {script!r}; expected one of {sorted(_SCRIPTS)}")
    return _SCRIPTS[script]


def _column(reward: str, columns: dict[str, Any], key: str) -> list:
    if key not in columns:
        raise ValueError(f"Reward {reward!r} needs the dataset column {key!r}; got {sorted(columns)}")
    return columns[key]


class Accuracy(Reward):
    """:func:`accuracy` with a weight.

    Args:
        weight: Multiplier of this reward in the total.
        name: Key in logs.
    """

    default_name = "accuracy"
    required_columns = ("answer",)

    def __init__(self, weight: float = 1.0, name: str | None = None) -> None:
        super().__init__(weight, name)

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        return accuracy(prompts, completions, **columns)


class Format(Reward):
    """:func:`format` with a weight.

    Args:
        weight: Multiplier of this reward in the total.
        name: Key in logs.
    """

    default_name = "format"

    def __init__(self, weight: float = 0.5, name: str | None = None) -> None:
        super().__init__(weight, name)

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        return format(prompts, completions, **columns)


class LanguageConsistency(Reward):
    """:func:`language_consistency` for a chosen script.

    Args:
        script: One of latin, cjk, cyrillic, greek, arabic, hebrew, devanagari.
        weight: Multiplier of this reward in the total.
        name: Key in logs.
    """

    default_name = "language_consistency"

    def __init__(self, script: str = "latin", weight: float = 0.1, name: str | None = None) -> None:
        _script_prefixes(script)  # fail at config time, not mid-training
        super().__init__(weight, name)
        self.script = script

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        return language_consistency(prompts, completions, script=self.script, **columns)


class OverlongPenalty(Reward):
    """:func:`overlong_penalty` for a length budget.

    Args:
        max_len: Completion tokens at which the penalty reaches -1 (usually
            the rollout's maximum completion length).
        buffer: Width of the linear ramp before ``max_len``.
        weight: Multiplier of this reward in the total.
        name: Key in logs.
    """

    default_name = "overlong_penalty"

    def __init__(self, max_len: int, buffer: int, weight: float = 1.0, name: str | None = None) -> None:
        if not 0 < buffer <= max_len:
            raise ValueError(f"OverlongPenalty needs 0 < buffer <= max_len, got {buffer=}, {max_len=}")
        super().__init__(weight, name)
        self.max_len = max_len
        self.buffer = buffer

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        return overlong_penalty(prompts, completions, max_len=self.max_len, buffer=self.buffer, **columns)
