"""Built-in tools and the built-in multi-turn game.

* :func:`calculator`: arithmetic only, evaluated by walking the expression's
  ``ast`` (never ``eval``), with bounds so ``9**9**9`` is refused at once.
* :func:`python`: runs the model's program in the sandbox of the
  ``code_unit_tests`` reward (:class:`~lit_grpo.rewards.sandbox.Sandbox`:
  no network, CPU/memory/process limits, a wall-clock kill after
  :data:`PYTHON_TIMEOUT`). The sandbox runs one program per CPU at a time;
  a call waiting for a free slot spends its toolbox timeout waiting, so with
  many episodes calling at once on few cores raise ``data.episodes.tool_timeout``.
* :class:`GuessNumber`: find a secret number with higher/lower feedback; its
  rows come from :func:`guess_number` (the ``guess_number`` built-in task).
"""

from __future__ import annotations

import ast
import functools
import math
import operator
import random

MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_BITS = 4096  # ~1233 decimal digits: any larger integer is refused, never computed
PYTHON_TIMEOUT = 5.0  # seconds; below Toolbox's default 10 s, so the sandbox's kill comes first
PYTHON_OUTPUT_CHARS = 2000  # what the model reads of one run's output

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression and returns its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(1234 + 5678) * 2".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression has {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}.")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"{expression!r} is not an arithmetic expression ({error.msg}).") from None
    return _number_text(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> int | float:
    """The value of an arithmetic ``node``; ValueError for anything else or a result out of bounds."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except OverflowError:
            raise ValueError("the result is too large.") from None
        if isinstance(value, complex):  # (-8) ** 0.5
            raise ValueError("the result is not a real number.")
        if isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS:
            raise ValueError(f"the result has more than {MAX_RESULT_BITS} bits.")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("the result is too large.")
        return value
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed; found {_describe(node)}.")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuses an integer power whose result would exceed the bit bound, before computing it."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * (abs(base).bit_length() - 1) > MAX_RESULT_BITS:
            raise ValueError(f"{base} ** {exponent} has more than {MAX_RESULT_BITS} bits.")


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    return f"{type(node).__name__} ({ast.unparse(node)[:40]!r})"


def _number_text(value: int | float) -> str:
    """Integers (and floats that hold one exactly) as integers; other floats to 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


@functools.cache
def _sandbox():
    # Imported here: lit_grpo.rewards imports torch, which nothing else in this package needs.
    from lit_grpo.rewards.sandbox import Sandbox

    return Sandbox(timeout=PYTHON_TIMEOUT)


def python(code: str) -> str:
    """Runs a Python program in a sandbox and returns what it printed.

    Args:
        code: A complete Python program; print the values you want to see.
    """
    result = _sandbox().run(code)
    if result.timed_out:
        return _clip(f"Timed out after {PYTHON_TIMEOUT:g}s.\n{result.stdout}")
    if not result.ok:
        error = result.stderr.strip() or f"exit status {result.returncode}"
        output = f"{result.stdout}\n" if result.stdout else ""
        return _clip(f"{output}Error:\n{error}", keep_end=True)
    return _clip(result.stdout) if result.stdout else "(no output: print the values you want to see)"


def _clip(text: str, keep_end: bool = False) -> str:
    """``text`` cut to :data:`PYTHON_OUTPUT_CHARS`: the start of output, the end of an error (its last line)."""
    if len(text) <= PYTHON_OUTPUT_CHARS:
        return text
    note = f"[... {len(text) - PYTHON_OUTPUT_CHARS} characters cut ...]"
    return f"{note}\n{text[-PYTHON_OUTPUT_CHARS:]}" if keep_end else f"{text[:PYTHON_OUTPUT_CHARS]}\n{note}"


def guess_number(n: int, seed: int, low: int = 1, high: int = 10) -> list[dict]:
    """Rows of the guess-a-number game (the ``guess_number`` built-in task) for :class:`GuessNumber`.

    Args:
        n: Number of rows.
        seed: Random seed of the secrets.
        low: Smallest possible secret.
        high: Largest possible secret.

    Returns:
        Rows with ``prompt``, ``secret``, ``low``, ``high`` and ``answer``
        (the secret as text, for answer-checking rewards).
    """
    if not low < high:
        raise ValueError(f"guess_number task: low={low}, high={high}; expected low < high.")
    rng = random.Random(seed)
    rows = []
    for game in range(1, n + 1):  # numbered: the data module tells rows apart by their prompts
        secret = rng.randint(low, high)
        prompt = f"Game {game}: I am thinking of a whole number from {low} to {high}. Find it, then tell me the number."
        rows.append({"prompt": prompt, "secret": secret, "low": low, "high": high, "answer": str(secret)})
    return rows


class GuessNumber:
    """Find a secret whole number; each guess is answered "higher", "lower" or "correct".

    The secret is the row's ``secret`` column, or else a draw seeded by
    ``seed`` and the row's prompt, so the episodes of one group (same row)
    play the same secret. The range is the row's ``low``/``high`` columns,
    or else the constructor's.

    Reward (:meth:`get_reward`), with ``M = max_guesses`` and ``k`` the guess
    that found the secret: ``1 + 0.5 * (M - k) / (M - 1)`` (1.5 at the first
    guess, 1.0 at the last allowed one; 1.0 when ``M == 1``); 0 when the
    secret was not found. Guesses outside the range count. With
    ``consistency > 0``, won or lost, each guess after the first that lies
    in the interval the answers so far leave open adds ``consistency / (M - 1)``:
    a shaping reward for reading the answers, which a fixed sequence of
    guesses earns only where it happens to agree with them.

    The game ends (:attr:`done`) at the right guess or the last allowed one,
    and with it the episode: guesses per game are the episode's turns.

    With ``show_interval``, a wrong guess is answered with that interval too
    ("higher: from 6 to 10 (3 guesses left)"): the game's state is in its last
    observation, as in text games that print the board, so the player need not
    carry every earlier answer in its head. It is the same game (same secrets,
    same reward); only the observations say more.

    Args:
        max_guesses: Guesses allowed per episode; later ones are refused.
        low: Smallest secret when the row has no ``low``.
        high: Largest secret when the row has no ``high``.
        seed: Seed of the draw for rows without a ``secret``.
        consistency: Reward for following every answer over ``M`` guesses
            (0 leaves it out).
        show_interval: Answer a wrong guess with the interval the answers so
            far leave open, as well as "higher" or "lower".
    """

    def __init__(
        self,
        max_guesses: int = 4,
        low: int = 1,
        high: int = 10,
        seed: int = 0,
        consistency: float = 0.0,
        show_interval: bool = False,
    ) -> None:
        if max_guesses < 1:
            raise ValueError(f"GuessNumber max_guesses={max_guesses}; expected >= 1.")
        if consistency < 0:
            raise ValueError(f"GuessNumber consistency={consistency}; expected >= 0.")
        self.max_guesses, self.default_range, self.seed = max_guesses, (low, high), seed
        self.consistency, self.show_interval = consistency, show_interval
        self.low, self.high, self.secret = low, high, low
        self.guesses, self.solved = 0, False
        self.open, self.consistent = (low, high), 0

    def reset(self, **row) -> str:
        """Starts a game for ``row``; returns the rules, appended to the prompt."""
        self.low, self.high = int(row.get("low", self.default_range[0])), int(row.get("high", self.default_range[1]))
        secret = row.get("secret")
        if secret is None:
            secret = random.Random(f"{self.seed}:{row.get('prompt', '')}").randint(self.low, self.high)
        if not self.low <= int(secret) <= self.high:
            raise ValueError(f"secret={secret!r} is outside the range {self.low}..{self.high}")
        self.secret, self.guesses, self.solved = int(secret), 0, False
        self.open, self.consistent = (self.low, self.high), 0  # what the answers so far leave possible
        return (
            f"You have {_guesses(self.max_guesses)}. Call the guess tool with a number; it answers "
            "higher, lower or correct."
        )

    def guess(self, number: int) -> str:
        """Guesses the secret number.

        Args:
            number: The guess, a whole number in the game's range.

        Returns:
            "higher" (the secret is larger), "lower" (it is smaller) or "correct";
            with ``show_interval``, "higher" and "lower" name the numbers still possible.
        """
        if self.solved:
            return f"correct: you already found it, {self.secret}."
        if self.guesses >= self.max_guesses:
            return "No guesses left: the game is over."
        self.guesses += 1
        low, high = self.open
        self.consistent += self.guesses > 1 and low <= number <= high
        if number == self.secret:
            self.solved = True
            return "correct"
        self.open = (max(low, number + 1), high) if number < self.secret else (low, min(high, number - 1))
        interval = f": from {self.open[0]} to {self.open[1]}" if self.show_interval else ""
        left = _guesses(self.max_guesses - self.guesses)
        return f"{'higher' if number < self.secret else 'lower'}{interval} ({left} left)"

    @property
    def done(self) -> bool:
        """The game is over (found, or no guesses left): the episode ends after this turn."""
        return self.solved or self.guesses >= self.max_guesses

    def get_reward(self) -> float:
        """1 plus a bonus for fewer guesses when solved, else 0, plus the consistency reward (class docstring)."""
        steps = max(self.max_guesses - 1, 1)
        shaping = self.consistency * self.consistent / steps
        if not self.solved:
            return shaping
        return 1.0 + 0.5 * (self.max_guesses - self.guesses) / steps + shaping


def _guesses(count: int) -> str:
    return f"{count} guess{'es' * (count != 1)}"
