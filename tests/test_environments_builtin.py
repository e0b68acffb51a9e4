"""The built-in tools (calculator, python), the GuessNumber game and EnvironmentFactory."""

from __future__ import annotations

import time

import pytest

from lit_grpo.environments import Toolbox, ToolCall, builtin
from lit_grpo.environments.builtin import GuessNumber, calculator, guess_number
from lit_grpo.environments.factory import EnvironmentFactory


# --------------------------------------------------------------------------- calculator
@pytest.mark.parametrize(
    "expression, value",
    [
        ("1234 + 5678", "6912"),
        ("(1234 + 5678) * 2", "13824"),
        ("7 / 2", "3.5"),
        ("6 / 2", "3"),  # an integral float prints as an integer
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("2 ** -2", "0.25"),
        ("-(3 - 5)", "2"),
        ("+4", "4"),
        ("0.1 + 0.2", "0.3"),  # 12 significant digits
        ("1.5e3 * 2", "3000"),
        ("2 ** 4000 // 2 ** 3999", "2"),  # big, in bounds
    ],
)
def test_calculator_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('ls')", "found Call"),
        ("__import__('os')", "found Call"),
        ("x + 1", "found the name 'x'"),
        ("(1).real", "found Attribute"),
        ("'a' * 3", "found the constant 'a'"),
        ("True + 1", "found the constant True"),
        ("[1, 2]", "found List"),
        ("1 << 4", "found BinOp"),
        ("9 ** 9 ** 9", "9 ** 387420489 has more than 4096 bits"),
        ("10 ** 5000", "10 ** 5000 has more than 4096 bits"),
        ("3 ** 3000", "the result has more than 4096 bits"),
        ("2.0 ** 10000", "too large"),
        ("1e308 * 10", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "is not an arithmetic expression"),
        ("1" * 1001, "at most 1000"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, message):
    start = time.monotonic()
    with pytest.raises(ValueError) as error:
        calculator(expression)
    assert message in str(error.value)
    assert time.monotonic() - start < 0.5  # refused, not computed


def test_calculator_errors_reach_the_model_as_observations():
    toolbox = Toolbox.from_config(["lit_grpo.environments.builtin.calculator"])
    refused, zero = toolbox.run(
        [ToolCall("calculator", {"expression": "__import__('os')"}), ToolCall("calculator", {"expression": "1 / 0"})]
    )
    assert refused.error and refused.content.startswith("Error: ValueError: only numbers")
    assert zero.error and zero.content == "Error: ZeroDivisionError: division by zero"


# --------------------------------------------------------------------------- python
def test_python_returns_stdout_or_the_error():
    assert builtin.python("print(6 * 7)") == "42\n"
    assert builtin.python("x = 1") == "(no output: print the values you want to see)"
    failed = builtin.python("print('before')\nraise KeyError('lost')")
    assert failed.startswith("before\n\nError:\nTraceback")
    assert failed.endswith("KeyError: 'lost'")


def test_python_output_is_capped():
    long = builtin.python("print('x' * 5000)")
    assert long.startswith("x" * builtin.PYTHON_OUTPUT_CHARS + "\n[... ")
    assert long.endswith("characters cut ...]")
    error = builtin.python("raise ValueError('y' * 5000 + 'END')")
    assert error.startswith("[... ") and error.endswith("END")


def test_python_times_out(monkeypatch):
    monkeypatch.setattr(builtin, "PYTHON_TIMEOUT", 1.0)
    builtin._sandbox.cache_clear()  # the sandbox is built once with the timeout
    try:
        start = time.monotonic()
        assert builtin.python("print('started', flush=True)\nwhile True: pass") == "Timed out after 1s.\nstarted\n"
        assert time.monotonic() - start < 5
    finally:
        builtin._sandbox.cache_clear()


# --------------------------------------------------------------------------- GuessNumber
def _play(guesses: list[int], secret: int = 7, max_guesses: int = 4, **kwargs):
    factory = EnvironmentFactory("lit_grpo.environments.builtin.GuessNumber", {"max_guesses": max_guesses, **kwargs})
    env, text, toolbox = factory.new({"prompt": "find it", "secret": secret, "low": 1, "high": 10})
    assert toolbox.names == ["guess"]
    plural = "guesses" if max_guesses > 1 else "guess"
    assert text == (
        f"You have {max_guesses} {plural}. Call the guess tool with a number; it answers higher, lower or correct."
    )
    observations = [toolbox.run([ToolCall("guess", {"number": g})])[0].content for g in guesses]
    return env, observations


def test_guess_number_won_in_three():
    env, observations = _play([5, 8])
    assert not env.done
    env, observations = _play([5, 8, 7])
    assert observations == ["higher (3 guesses left)", "lower (2 guesses left)", "correct"]
    assert env.done  # found: the game, and the episode, are over
    assert env.get_reward() == pytest.approx(1 + 0.5 * (4 - 3) / (4 - 1))  # 1.1667


def test_guess_number_won_at_once_and_after_the_win():
    env, observations = _play([7, 7])
    assert observations == ["correct", "correct: you already found it, 7."]
    assert env.get_reward() == 1.5  # 1 + 0.5 * (4 - 1) / 3


def test_guess_number_lost():
    env, observations = _play([1, 2, 3, 10, 7])
    assert observations == [
        "higher (3 guesses left)",
        "higher (2 guesses left)",
        "higher (1 guess left)",
        "lower (0 guesses left)",
        "No guesses left: the game is over.",
    ]
    assert env.done and not env.solved
    assert env.get_reward() == 0.0  # the fifth guess was right but refused


def test_guess_number_consistency_rewards_guesses_the_answers_allow():
    # 5 -> higher (6..10 open), 8 -> lower (6..7 open), 7 correct: both later guesses follow the answers
    env, _ = _play([5, 8, 7], consistency=0.3)
    assert env.get_reward() == pytest.approx(1 + 0.5 * (4 - 3) / 3 + 0.3 * 2 / 3)
    # a blind sequence: 2 -> higher (3..10), 1 breaks it, 9 -> lower (3..8), 3 -> higher (4..8): 2 of 3 allowed
    env, _ = _play([2, 1, 9, 3], consistency=0.3)
    assert env.get_reward() == pytest.approx(0.3 * 2 / 3)  # lost, but it read two answers
    env, _ = _play([5, 8, 7])
    assert env.get_reward() == pytest.approx(1 + 0.5 / 3)  # off by default: the reward of before
    with pytest.raises(ValueError, match="consistency=-1"):
        GuessNumber(consistency=-1)


def test_guess_number_show_interval_names_the_numbers_still_possible():
    # 5 -> higher (6..10), 9 -> lower (6..8), 2 ignores the answers (6..8 stays), 7 correct
    env, observations = _play([5, 9, 2, 7], show_interval=True)
    assert observations == [
        "higher: from 6 to 10 (3 guesses left)",
        "lower: from 6 to 8 (2 guesses left)",
        "higher: from 6 to 8 (1 guess left)",
        "correct",
    ]
    assert env.get_reward() == pytest.approx(1.0)  # the same reward as without the interval


def test_guess_number_single_guess_and_drawn_secret():
    env, observations = _play([7], max_guesses=1)
    assert observations == ["correct"] and env.get_reward() == 1.0
    first, second = GuessNumber(seed=3), GuessNumber(seed=3)
    first.reset(prompt="same row")
    second.reset(prompt="same row")
    assert first.secret == second.secret and 1 <= first.secret <= 10  # a group plays one secret


def test_guess_number_task_rows_and_builtin_registration():
    from lit_grpo.data.tasks import TASKS

    rows = TASKS["guess_number"](n=50, seed=0, low=1, high=10)
    assert rows == guess_number(n=50, seed=0)
    assert {row["secret"] for row in rows} == set(range(1, 11))
    assert all(row["answer"] == str(row["secret"]) and "1 to 10" in row["prompt"] for row in rows)
    assert len({row["prompt"] for row in rows}) == 50  # told apart by prompt
    EnvironmentFactory("lit_grpo.environments.builtin.GuessNumber").check(rows)
    with pytest.raises(ValueError, match="low=5, high=5; expected low < high"):
        guess_number(n=1, seed=0, low=5, high=5)


# --------------------------------------------------------------------------- EnvironmentFactory
class NoReset:
    def act(self, x: int) -> str:
        """Acts.

        Args:
            x: How.
        """
        return str(x)


class NoTools:
    def reset(self, **row) -> None:
        return None


class Undocumented:
    def reset(self, **row) -> None:
        return None

    def act(self, x: int) -> str:
        return str(x)


class Picky:
    """Refuses rows without ``level``; returns a number from reset when asked to."""

    def __init__(self, depth: int = 1) -> None:
        self.depth = depth

    def reset(self, **row) -> str | None:
        if row.get("bad_reset_type"):
            return 3
        return f"level {row['level']}"

    def act(self, x: int) -> str:
        """Acts.

        Args:
            x: How.
        """
        return str(x * self.depth)

    @property
    def state(self) -> str:  # a property is not a tool, and is not evaluated while looking for tools
        raise AssertionError("evaluated")

    def _helper(self) -> None:
        """Private: not a tool."""


class DoneMethod(Picky):
    def done(self) -> bool:
        """Whether the game is over (a method: never read as the flag, so refused).

        Returns:
            True when over.
        """
        return True


def test_factory_finds_tools_and_builds_fresh_instances():
    factory = EnvironmentFactory(f"{__name__}.Picky", {"depth": 3}, timeout=2.0)
    assert factory.tool_names == ["act"] and not factory.has_reward
    first, text, toolbox = factory.new({"level": 2})
    second, _, _ = factory.new({"level": 2})
    assert first is not second and text == "level 2"
    assert toolbox.timeout == 2.0 and toolbox.run([ToolCall("act", {"x": 2})])[0].content == "6"
    assert EnvironmentFactory("lit_grpo.environments.builtin.GuessNumber").has_reward


@pytest.mark.parametrize(
    "class_path, init_args, message",
    [
        (
            "no_such_package_xyz.Env",
            None,
            "data.episodes.environment.class_path='no_such_package_xyz.Env': cannot import",
        ),
        ("lit_grpo.environments.builtin.calculator", None, "is a function, not a class"),
        (f"{__name__}.NoReset", None, "NoReset has no reset(self, **row) method"),
        (f"{__name__}.NoTools", None, "NoTools has no tool methods"),
        (f"{__name__}.Undocumented", None, "Undocumented.act has no usable schema"),
        (f"{__name__}.Picky", {"width": 2}, "Picky(**{'width': 2}) raised TypeError"),
        (f"{__name__}.DoneMethod", None, "DoneMethod.done is a method; make it a boolean attribute or a @property"),
    ],
)
def test_factory_setup_errors(class_path, init_args, message):
    with pytest.raises(ValueError) as error:
        EnvironmentFactory(class_path, init_args)
    assert message in str(error.value)
    assert str(error.value).startswith("data.episodes.environment")


def test_factory_check_names_the_class_the_row_and_the_error():
    factory = EnvironmentFactory(f"{__name__}.Picky")
    factory.check([{"level": 1}, {"level": 2}])
    with pytest.raises(ValueError) as error:
        factory.check([{"level": 1}, {"prompt": "p" * 500}])
    text = str(error.value)
    assert "Picky.reset raised KeyError: 'level' on row {'prompt': 'ppp" in text
    assert len(text) < 400  # the row is shortened
    with pytest.raises(ValueError, match=r"Picky.reset returned a int on row \{'bad_reset_type': True\}"):
        factory.new({"bad_reset_type": True})
    with pytest.raises(ValueError, match=r"secret=11 is outside the range 1..10"):
        EnvironmentFactory("lit_grpo.environments.builtin.GuessNumber").check([{"secret": 11}])


GUESS = "lit_grpo.environments.builtin.GuessNumber"


@pytest.mark.parametrize(
    "options, init_args",
    [
        # jsonargparse files --data.episodes.environment.init_args.max_guesses=3 as environment["max_guesses"]
        # (the field is a dict); it was silently ignored, the config's 4 kept.
        (["--data.episodes.environment.init_args.max_guesses=3"], {"max_guesses": 3, "show_interval": True}),
        # A whole new value or class over the config's crashed inside jsonargparse ('dict' object has
        # no attribute 'init_args'); it now replaces the config's environment.
        (
            [f'--data.episodes.environment={{"class_path": "{GUESS}", "init_args": {{"max_guesses": 3}}}}'],
            {"max_guesses": 3},
        ),
        (
            ["--data.episodes.environment", f'{{"class_path": "{GUESS}", "init_args": {{"max_guesses": 3}}}}'],
            {"max_guesses": 3},
        ),
        (
            [f"--data.episodes.environment.class_path={GUESS}", "--data.episodes.environment.init_args.max_guesses=3"],
            {"max_guesses": 3},
        ),
    ],
)
def test_the_environment_set_on_the_command_line_reaches_the_run(capsys, options, init_args):
    from pathlib import Path

    import yaml

    from lit_grpo.cli import main
    from lit_grpo.data.episodes import EpisodeSetup, EpisodesSpec

    config = Path(__file__).parent.parent / "configs" / "guess_number.yaml"
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config), *options, "--print_config"])
    environment = yaml.safe_load(capsys.readouterr().out)["data"]["episodes"]["environment"]
    setup = EpisodeSetup(EpisodesSpec(environment=environment, max_turns=5), max_episode_tokens=240)
    assert setup.factory.init_args == init_args
    environment, rules, _ = setup.factory.new({"secret": 7})
    assert environment.max_guesses == 3 and "3 guesses" in rules
