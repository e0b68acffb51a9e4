"""The Countdown game reward (as in TinyZero): reach ``target`` with ``numbers``.

The answer is an arithmetic expression that uses every given number exactly
once with ``+ - * /`` and parentheses. It is model-written text, so it is
never passed to ``eval``: a small AST walker accepts only integer literals,
the four operators and unary minus, and computes with exact fractions (so
``6 / 4 * 2`` is exactly 3, and float rounding cannot make a wrong answer right).
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction
from typing import Any

from lit_grpo.rewards.base import Reward

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MAX_EXPRESSION_CHARS = 200  # a real answer is short; bounds parse time
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class UnsafeExpression(ValueError):
    """The expression uses something other than integers and + - * / ( )."""


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """Evaluates an arithmetic expression exactly, without ``eval``.

    Args:
        expression: e.g. ``"(25 - 5) * 4"``.

    Returns:
        The value and the integer literals used, in order.

    Raises:
        UnsafeExpression: Anything but integer literals, ``+ - * /``, unary minus, parentheses.
        ZeroDivisionError: Division by zero.
    """
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise UnsafeExpression(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError) as e:
        raise UnsafeExpression(f"not an expression: {e}") from None
    literals: list[int] = []
    return _walk(tree.body, literals), literals


def _walk(node: ast.AST, literals: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left, literals), _walk(node.right, literals)
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_walk(node.operand, literals)
    raise UnsafeExpression(f"{type(node).__name__} is not allowed")


def _expression(completion: str) -> str:
    tagged = _ANSWER.findall(completion)
    text = tagged[-1] if tagged else (completion.strip().splitlines() or [""])[-1]
    return text.split("=")[0].strip()  # "(25 - 5) * 4 = 80" states the target too


def _score(completion: str, numbers: list[int], target: int) -> float:
    try:
        value, used = evaluate(_expression(completion))
    except (UnsafeExpression, ZeroDivisionError):
        return 0.0
    return float(sorted(used) == sorted(int(n) for n in numbers) and value == int(target))


def countdown(prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
    """1.0 where the answer uses each of ``numbers`` exactly once and equals ``target``.

    The expression is the last ``<answer>`` body, else the completion's last
    line; a trailing ``= …`` is ignored.
    """
    for key in ("numbers", "target"):
        if key not in columns:
            raise ValueError(f"Reward 'countdown' needs the dataset column {key!r}; got {sorted(columns)}")
    return [
        None if nums is None or tgt is None else _score(c, nums, tgt)
        for c, nums, tgt in zip(completions, columns["numbers"], columns["target"])
    ]


class Countdown(Reward):
    """:func:`countdown` with a weight.

    Args:
        weight: Multiplier of this reward in the total.
        name: Key in logs.
    """

    default_name = "countdown"
    required_columns = ("numbers", "target")

    def __init__(self, weight: float = 1.0, name: str | None = None) -> None:
        super().__init__(weight, name)

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        return countdown(prompts, completions, **columns)
