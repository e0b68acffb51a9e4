"""Multi-step word problems in the style of GSM8K, generated offline.

A problem is a chain of integer operations on one running quantity: a start
value, then ``min_steps..max_steps`` of ``+ - * /`` (every intermediate value a
positive integer no larger than ``max_value``, every division exact). Each
operation is told in one of several phrasings (buying, selling, sharing
equally, groups of, more/fewer/times as many as someone else), with names and
objects drawn from small lists. The ``answer`` column is a worked solution
ending in ``#### N``, exactly GSM8K's shape, so the same ``Accuracy`` reward
and loader serve both; ``start`` and ``steps`` (``["+ 5", "* 3"]``) record the
chain so the answer can be recomputed without reading the text.
"""

from __future__ import annotations

import random

NAMES = (
    "Ava",
    "Ben",
    "Chloe",
    "Dev",
    "Elena",
    "Farid",
    "Grace",
    "Hugo",
    "Iris",
    "Jonas",
    "Kemi",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Priya",
)
ITEMS = (
    "apples",
    "marbles",
    "stickers",
    "pencils",
    "cookies",
    "books",
    "stamps",
    "shells",
    "cards",
    "eggs",
    "coins",
    "beads",
)

# ``{new}`` in a phrasing hands the running quantity to a new person: the
# following steps, and the question, are about them.
TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "{name} buys {n} more {items}.",
        "{friend} gives {name} {n} {items}.",
        "Later, {name} finds another {n} {items}.",
        "{new} has {n} more {items} than {name}.",
    ),
    "-": (
        "{name} sells {n} of the {items}.",
        "{name} gives {n} {items} to {friend}.",
        "{n} of {name}'s {items} get lost.",
        "{new} has {n} fewer {items} than {name}.",
    ),
    "*": (
        "{name} then buys more {items}, until {name} has {times} as many as before.",
        "{name}'s pile of {items} then grows to {times} its size.",
        "{new} has {times} as many {items} as {name}.",
    ),
    "/": (
        "{name} splits the {items} into {n} equal piles and keeps only one pile.",
        "{name} shares all the {items} equally among {n} friends, one of whom is {new}.",
        "{new} has {fraction} as many {items} as {name}.",
    ),
}
STARTS = (
    "{name} has {n} {items}.",
    "{name} starts the day with {n} {items}.",
    "There are {n} {items} in {name}'s basket.",
)
# A first ``*`` step may instead be told as groups of: start * n.
GROUPS = "{name} has {start} bags with {n} {items} in each."
QUESTIONS = (
    "How many {items} does {name} have now?",
    "How many {items} does {name} end up with?",
    "In the end, how many {items} does {name} have?",
)

_TIMES = {2: "twice", 3: "three times", 4: "four times"}
_FRACTIONS = {
    2: "half",
    3: "a third",
    4: "a quarter",
    5: "a fifth",
    6: "a sixth",
    7: "a seventh",
    8: "an eighth",
    9: "a ninth",
    10: "a tenth",
}


def word_problems(
    n: int,
    seed: int,
    min_steps: int = 2,
    max_steps: int = 4,
    max_value: int = 100,
    ops: str = "+-*/",
    max_factor: int = 5,
) -> list[dict]:
    """Generate ``n`` distinct multi-step word problems with integer answers.

    Args:
        n: Number of rows.
        seed: Random seed; the same seed (and options) gives the same rows.
        min_steps: Fewest operations per problem.
        max_steps: Most operations per problem.
        max_value: Largest start, operand and intermediate value.
        ops: Which of ``+ - * /`` to draw from.
        max_factor: Largest multiplier or divisor.

    Returns:
        Rows with ``prompt`` (the question), ``answer`` (worked lines, then
        ``#### N``), ``start`` (int) and ``steps`` (``["* 3", "- 4"]``).
    """
    _check(min_steps, max_steps, max_value, ops, max_factor)
    rng = random.Random(seed)
    rows: dict[str, dict] = {}  # by prompt: distinct questions, in order
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(
                f"word_problems task: found only {len(rows)} of n={n} distinct problems with "
                f"min_steps={min_steps}, max_steps={max_steps}, max_value={max_value}, ops={ops!r}, "
                f"max_factor={max_factor}; raise max_value or allow more ops."
            )
        chain = _chain(rng, rng.randint(min_steps, max_steps), max_value, ops, max_factor)
        if chain is not None:
            row = _render(rng, *chain)
            rows.setdefault(row["prompt"], row)
    return list(rows.values())


def _check(min_steps: int, max_steps: int, max_value: int, ops: str, max_factor: int) -> None:
    if not 1 <= min_steps <= max_steps:
        raise ValueError(
            f"word_problems min_steps={min_steps}, max_steps={max_steps}; expected 1 <= min_steps <= max_steps."
        )
    if not ops or set(ops) - set(TEMPLATES):
        raise ValueError(f"word_problems ops={ops!r}; expected a non-empty string drawn from '+-*/'.")
    if max_factor < 2:
        raise ValueError(f"word_problems max_factor={max_factor}; expected >= 2.")
    if max_value < 2 * max_factor:
        raise ValueError(f"word_problems max_value={max_value}; expected >= 2 * max_factor = {2 * max_factor}.")


def _chain(
    rng: random.Random, count: int, max_value: int, ops: str, max_factor: int
) -> tuple[int, list[tuple[str, int]]] | None:
    """A start value and ``count`` steps that stay in ``1..max_value``; None if the draw got stuck."""
    start = value = rng.randint(2, max_value)
    steps = []
    for _ in range(count):
        choices = {op: _operands(op, value, max_value, max_factor) for op in ops}
        feasible = sorted(op for op, operands in choices.items() if operands)
        if not feasible:
            return None
        op = rng.choice(feasible)
        operand = rng.choice(choices[op])
        value = _apply(op, value, operand)
        steps.append((op, operand))
    return start, steps


def _operands(op: str, value: int, max_value: int, max_factor: int) -> range | list[int]:
    """Operands that keep ``value op operand`` an integer in ``1..max_value``."""
    if op == "+":
        return range(1, max_value - value + 1)
    if op == "-":
        return range(1, value)
    if op == "*":
        return range(2, min(max_factor, max_value // value) + 1)
    return [k for k in range(2, max_factor + 1) if value % k == 0]


def _apply(op: str, value: int, operand: int) -> int:
    return {"+": value + operand, "-": value - operand, "*": value * operand, "/": value // operand}[op]


def _render(rng: random.Random, start: int, steps: list[tuple[str, int]]) -> dict:
    """The question, its worked answer and the chain, in randomly drawn words."""
    names: list[str] = []

    def person(current: str = "") -> str:
        """The next name: none repeats until all have appeared, and never ``current`` (the subject)."""
        if not names:
            names.extend(other for other in rng.sample(NAMES, len(NAMES)) if other != current)
        return names.pop()

    name, items = person(), rng.choice(ITEMS)
    sentences, lines, value = [], [], start
    todo = steps
    if steps[0][0] == "*" and rng.random() < 0.5:
        value = start * steps[0][1]
        sentences.append(GROUPS.format(name=name, start=start, n=steps[0][1], items=items))
        lines.append(f"{name} has {start} * {steps[0][1]} = {value} {items}.")
        todo = steps[1:]
    else:
        sentences.append(rng.choice(STARTS).format(name=name, n=start, items=items))
    for op, operand in todo:
        template = rng.choice(TEMPLATES[op])
        new = person(name) if "{new}" in template else name
        friend = person(name) if "{friend}" in template else None
        sentences.append(
            template.format(
                name=name,
                new=new,
                friend=friend,
                n=operand,
                items=items,
                times=_TIMES.get(operand, f"{operand} times"),
                fraction=_FRACTIONS.get(operand, f"1/{operand}"),
            )
        )
        result = _apply(op, value, operand)
        lines.append(f"{new} has {value} {op} {operand} = {result} {items}.")
        name, value = new, result
    sentences.append(rng.choice(QUESTIONS).format(name=name, items=items))
    return {
        "prompt": " ".join(sentences),
        "answer": "\n".join([*lines, f"#### {value}"]),
        "start": start,
        "steps": [f"{op} {operand}" for op, operand in steps],
    }
