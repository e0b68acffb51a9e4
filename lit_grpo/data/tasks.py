"""Built-in tasks generated on the fly: no download, seedable, verifiable.

``arithmetic``: "What is 47 + 38?" with the exact answer (+, -, x).
``arithmetic_preferences``: the same questions as preference pairs for DPO,
the worked answer ("47 + 38 = 85") chosen and a plausible slip rejected.
``arithmetic_sft``: the same questions with that worked answer as the
demonstration (``completion``), for supervised fine-tuning.
``countdown``: reach a target with the given numbers, each used once, with
``+ - * /``; the ``countdown`` reward checks the expression with a safe
evaluator. Each row also carries one valid solution as ``answer``.
``word_problems``: GSM8K-style multi-step word problems with a ``#### N``
answer (:mod:`lit_grpo.data.word_problems`).
``guess_number``: games of the ``GuessNumber`` environment, a secret per row
(:func:`lit_grpo.environments.builtin.guess_number`).
``reasoning_gym``: any of reasoning-gym's 100+ generated reasoning tasks
(``task_args: {name: chain_sum, ...}``), scored by its own ``score_answer``
(:class:`~lit_grpo.rewards.ReasoningGym`); the optional extra ``reasoning``.
"""

from __future__ import annotations

import difflib
import random
from typing import Callable

from lit_grpo.data.word_problems import word_problems
from lit_grpo.environments.builtin import guess_number

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic(n: int, seed: int, digits: int | list[int] = 2, ops: str = "+-*") -> list[dict]:
    """Generate ``n`` distinct "What is A op B?" questions.

    Args:
        n: Number of rows.
        seed: Random seed; the same seed gives the same rows.
        digits: Digits per operand (2 gives 10..99), or ``[digits of A,
            digits of B]`` (``[3, 2]``: "What is 347 + 58?").
        ops: Which of ``+ - *`` to draw from.

    Returns:
        Rows with ``prompt`` and ``answer`` (the exact integer result as text).
    """
    return [
        {"prompt": f"What is {a} {op} {b}?", "answer": str(_OPS[op](a, b))}
        for a, op, b in _operands(n, seed, digits, ops)
    ]


SLIPS = ("off_by_1", "off_by_10", "swapped")
"""The kinds of near miss :func:`arithmetic_preferences` rejects: the last digit off by one,
the tens digit off by one, the last two digits swapped."""


def arithmetic_preferences(
    n: int, seed: int, digits: int | list[int] = 2, ops: str = "+-*", slips: list[str] | dict[str, float] | None = None
) -> list[dict]:
    """Generate ``n`` arithmetic preference pairs: a right and a wrong answer.

    The questions are those of :func:`arithmetic` with the same arguments.
    The rejected answer is a slip a model plausibly makes (off by one, off by
    ten, the last two digits swapped), so the pair differs only in the result.

    Args:
        n: Number of rows.
        seed: Random seed; the same seed gives the same rows.
        digits: Digits per operand (2 gives 10..99), or ``[digits of A, digits of B]``.
        ops: Which of ``+ - *`` to draw from.
        slips: The kinds of slip to draw from (:data:`SLIPS`); all by default, each
            near miss equally likely. A mapping ``{kind: weight}`` draws the kind first,
            in those proportions among the kinds the answer has, then one of its near
            misses: ``{off_by_1: 3, off_by_10: 1}`` makes a quarter of the pairs ±10.
            An answer that has none of the kinds (``swapped`` alone, and equal digits)
            gets any near miss.

    Returns:
        Rows with ``prompt``, ``chosen``, ``rejected`` and ``answer``.
    """
    unknown = sorted(set(slips or ()) - set(SLIPS))
    if slips is not None and (
        unknown
        or not slips
        or (isinstance(slips, dict) and not all(type(w) in (int, float) and w > 0 for w in slips.values()))
    ):
        raise ValueError(
            f"arithmetic_preferences slips={slips!r}; expected a non-empty list drawn from {SLIPS}, "
            "or a mapping of those kinds to positive weights."
        )
    rng = random.Random(seed + 1)  # a stream of its own: questions stay those of `arithmetic`
    rows = []
    for a, op, b in _operands(n, seed, digits, ops):
        right = _OPS[op](a, b)
        rows.append(
            {
                "prompt": f"What is {a} {op} {b}?",
                "chosen": f"{a} {op} {b} = {right}",
                "rejected": f"{a} {op} {b} = {draw_near_miss(rng, right, slips)}",
                "answer": str(right),
            }
        )
    return rows


def draw_near_miss(rng: random.Random, right: int, slips: list[str] | dict[str, float] | None = None) -> int:
    """One of :func:`near_misses` of ``right``, drawn with ``rng`` as :func:`arithmetic_preferences`
    draws its rejected answers: among those of the ``slips`` kinds (any if none is), and with a
    mapping ``{kind: weight}`` the kind first, by weight among the kinds ``right`` has."""
    wrong = near_misses(right)
    if slips:
        wrong = [w for w in wrong if slip_kind(right, w) in slips] or wrong
    if isinstance(slips, dict) and len(kinds := sorted({slip_kind(right, w) for w in wrong} & set(slips))) > 1:
        kind = rng.choices(kinds, [slips[k] for k in kinds])[0]
        wrong = [w for w in wrong if slip_kind(right, w) == kind]
    return rng.choice(wrong)


def arithmetic_sft(n: int, seed: int, digits: int | list[int] = 2, ops: str = "+-*") -> list[dict]:
    """Generate ``n`` arithmetic demonstrations: the questions of :func:`arithmetic`
    with the worked answer as ``completion`` (the chosen reply of :func:`arithmetic_preferences`).

    Returns:
        Rows with ``prompt``, ``completion`` and ``answer``.
    """
    return [
        {"prompt": row["prompt"], "completion": row["chosen"], "answer": row["answer"]}
        for row in arithmetic_preferences(n, seed, digits, ops)
    ]


def near_misses(right: int) -> list[int]:
    """The wrong results close to ``right`` that :func:`arithmetic_preferences` draws its rejected
    answers from, ascending: +-1, +-10, and its last two digits swapped (where that differs)."""
    sign, digits = ("-" if right < 0 else ""), str(abs(right))
    swapped = int(sign + digits[:-2] + digits[-1] + digits[-2]) if len(digits) > 1 else right
    return sorted({right + 1, right - 1, right + 10, right - 10, swapped} - {right})


def slip_kind(right: int, wrong: int) -> str:
    """Which of :data:`SLIPS` the near miss ``wrong`` of ``right`` is (a swap differs by a multiple of 9)."""
    return {1: "off_by_1", 10: "off_by_10"}.get(abs(right - wrong), "swapped")


class TooFewQuestions(ValueError):
    """A built-in task asked for more distinct questions than it has (``capacity``)."""

    def __init__(self, message: str, capacity: int) -> None:
        super().__init__(message)
        self.capacity = capacity


def _operands(n: int, seed: int, digits: int | list[int], ops: str) -> list[tuple[int, str, int]]:
    """``n`` distinct ``(a, op, b)`` triples with ``digits``-digit operands (one count, or one each)."""
    bad = set(ops) - set(_OPS)
    if not ops or bad:
        raise ValueError(f"task ops={ops!r}; expected a non-empty string drawn from '+-*'.")
    counts = [digits, digits] if isinstance(digits, int) else list(digits)
    if len(counts) != 2 or any(not isinstance(d, int) or d < 1 for d in counts):
        raise ValueError(
            f"task digits={digits!r}; expected an integer >= 1, or two of them ([digits of A, digits of B])."
        )
    (low_a, high_a), (low_b, high_b) = [(0 if d == 1 else 10 ** (d - 1), 10**d - 1) for d in counts]
    capacity = (high_a - low_a + 1) * (high_b - low_b + 1) * len(ops)
    if n > capacity:
        raise TooFewQuestions(
            f"arithmetic task with digits={digits!r}, ops={ops!r}: {n} questions asked, "
            f"it has {capacity} distinct ones.",
            capacity,
        )
    rng = random.Random(seed)
    seen: dict[tuple[int, str, int], None] = {}  # insertion-ordered set
    while len(seen) < n:
        a, b, op = rng.randint(low_a, high_a), rng.randint(low_b, high_b), rng.choice(ops)
        seen.setdefault((a, op, b))
    return list(seen)


def countdown(n: int, seed: int, count: int = 3, max_number: int = 20) -> list[dict]:
    """Generate ``n`` countdown puzzles that have a solution.

    Args:
        n: Number of rows.
        seed: Random seed.
        count: Numbers per puzzle (each used exactly once).
        max_number: Numbers are drawn from ``1..max_number``.

    Returns:
        Rows with ``prompt``, ``numbers`` (list of int), ``target`` (int) and
        ``answer`` (one expression that reaches the target).
    """
    if count < 2:
        raise ValueError(f"countdown count={count}; expected >= 2.")
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        numbers = [rng.randint(1, max_number) for _ in range(count)]
        expression, target = _random_expression(numbers, rng)
        if target <= 0 or target != int(target):
            continue
        target = int(target)
        prompt = (
            f"Using the numbers {numbers}, write an equation that equals {target}. "
            "Use each number exactly once and only + - * / and parentheses. "
            "Give the equation inside <answer></answer>, for example <answer>(1 + 2) * 3</answer>."
        )
        rows.append({"prompt": prompt, "numbers": numbers, "target": target, "answer": expression})
    return rows


def _random_expression(numbers: list[int], rng: random.Random) -> tuple[str, float]:
    order = numbers[:]
    rng.shuffle(order)
    expression, value = str(order[0]), float(order[0])
    for number in order[1:]:
        op = rng.choice("+-*/")
        if op == "/" and (number == 0 or value % number):
            op = "+"
        value = {"+": value + number, "-": value - number, "*": value * number, "/": value / number}[op]
        expression = f"({expression} {op} {number})"
    return expression, value


def reasoning_gym(n: int, seed: int, name: str | None = None, **config) -> list[dict]:
    """``n`` rows of a reasoning-gym task (https://github.com/open-thought/reasoning-gym), generated
    offline by its own generator: ``prompt`` (its question), ``answer`` and ``metadata`` (what its
    scorer reads; :class:`~lit_grpo.rewards.ReasoningGym` scores with it).

    Args:
        n: Rows (the training rows plus the held-out ones, or a slice's size).
        seed: The generator's seed (``data.seed``).
        name: The task, e.g. ``basic_arithmetic``, ``chain_sum``, ``leg_counting``.
        config: The task's own options (``min_terms``, ``max_digits``, ...).

    Raises:
        ValueError: reasoning-gym is not installed, the task is unknown (the close names are
            listed), or the task refuses its options.
    """
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(
            "data.source.dataset='reasoning_gym' needs the reasoning-gym package: pip install "
            "'lit_grpo[reasoning]' (or pip install reasoning-gym)."
        ) from None
    tasks = sorted(reasoning_gym.factory.DATASETS)
    if name not in reasoning_gym.factory.DATASETS:
        close = difflib.get_close_matches(str(name), tasks, n=5, cutoff=0.5)
        hint = f"close ones: {close}" if close else f"its {len(tasks)} tasks begin {tasks[:8]}"
        raise ValueError(
            f"data.source.task_args.name={name!r} is not a reasoning-gym task; {hint} "
            "(reasoning_gym.factory.DATASETS lists them all)."
        )
    for key, ours in (("size", "data.source.train_size"), ("seed", "data.seed")):
        if key in config:
            raise ValueError(
                f"data.source.task_args.{key}={config[key]!r}: reasoning-gym's {key} is {ours} here; "
                "drop it from task_args."
            )
    try:
        dataset = reasoning_gym.create_dataset(name, size=n, seed=seed, **config)
    except (TypeError, ValueError, AssertionError) as error:
        raise ValueError(
            f"data.source.task_args={{'name': {name!r}, **{config!r}}}: reasoning-gym refuses them: {error}"
        ) from None
    return [
        {"prompt": entry["question"], "answer": str(entry["answer"]), "metadata": entry["metadata"]}
        for entry in dataset
    ]


TASKS: dict[str, Callable[..., list[dict]]] = {
    "arithmetic": arithmetic,
    "arithmetic_preferences": arithmetic_preferences,
    "arithmetic_sft": arithmetic_sft,
    "countdown": countdown,
    "word_problems": word_problems,
    "guess_number": guess_number,
    "reasoning_gym": reasoning_gym,
}
