"""Multi-turn environments: TRL's ``environment_factory`` contract, built from YAML.

An environment is a class with ``reset(**row) -> str | None`` (called once
per episode with the dataset row; its text, if any, is appended to the
prompt's last user message), public methods the model may call as tools
(typed, Google-style docstrings, bound to the instance so they can change its
state), and optionally ``get_reward() -> float``, read when the episode ends.
Every method whose name does not start with ``_``, other than ``reset`` and
``get_reward``, is a tool, exactly as in TRL's ``GRPOTrainer``.

:class:`EnvironmentFactory` builds one fresh instance per episode (so the G
episodes of a group never share state) and checks the class when it is
built, and every row's ``reset`` in :meth:`EnvironmentFactory.check`, so a
broken environment fails before any training.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from lit_grpo.environments.toolbox import Toolbox, import_object

_RESERVED = ("reset", "get_reward", "done")


@runtime_checkable
class Environment(Protocol):
    """TRL's environment contract: ``reset``, public tool methods, optional ``get_reward``; and
    optionally a boolean ``done`` (attribute or property) that ends the episode when it turns true."""

    def reset(self, **row) -> str | None:
        """Starts an episode for ``row``; returns text appended to the last user message, or None."""


class EnvironmentFactory:
    """Builds one environment instance per episode and checks it early.

    Args:
        environment: What builds an instance: the dotted path of the environment class
            (``lit_grpo.environments.builtin.GuessNumber``, YAML's ``class_path``), the class,
            or any zero-argument callable returning an instance (TRL's ``environment_factory``).
        init_args: Keyword arguments of the class's constructor (not for a factory).
        field: How error messages name the configuration entry.
        timeout: Wall-clock seconds one tool call may run.

    Raises:
        ValueError: The class does not import, cannot be built from
            ``init_args``, builds something without ``reset``, has no tool method, a tool
            method lacks type hints or a docstring, or ``done`` (the flag
            that ends an episode) is a method.

    Attributes:
        class_path: How messages name the environment (the dotted path, or the class's or factory's name).
        has_reward: The class defines ``get_reward`` (the environment owns a reward).
        tool_names: The names of its tool methods.
    """

    def __init__(
        self,
        environment: str | Callable[[], object],
        init_args: dict | None = None,
        *,
        field: str = "data.episodes.environment",
        timeout: float = 10.0,
    ) -> None:
        self.init_args = dict(init_args or {})
        self.field = field
        self.timeout = timeout
        if isinstance(environment, str):
            self.class_path = environment
            self.make = import_object(environment, f"{field}.class_path")
            if not inspect.isclass(self.make):
                raise ValueError(f"{field}.class_path={environment!r} is a {type(self.make).__name__}, not a class.")
        elif callable(environment):
            self.make = environment
            self.class_path = (
                f"{getattr(environment, '__module__', '?')}.{getattr(environment, '__qualname__', environment)}"
            )
            if self.init_args and not inspect.isclass(environment):
                raise ValueError(
                    f"{field}: init_args {self.init_args!r} given with the factory {self.class_path}; "
                    "a factory is called without arguments (bind them in it)."
                )
        else:
            raise ValueError(
                f"{field}={environment!r}; expected {{class_path: ..., init_args: {{...}}}}, an "
                "environment class, or a zero-argument factory returning an instance."
            )
        probe = self._instance()
        self.cls = type(probe)
        if not callable(getattr(self.cls, "reset", None)):
            made = "" if inspect.isclass(self.make) else f" returns a {self.cls.__name__}, which"
            raise ValueError(
                f"{field}: {self.class_path}{made} has no reset(self, **row) method; an environment "
                "needs one (it may return None)."
            )
        self.has_reward = callable(getattr(self.cls, "get_reward", None))
        if inspect.isfunction(getattr(self.cls, "done", None)):
            raise ValueError(
                f"{field}: {self.class_path}.done is a method; make it a boolean attribute or a "
                "@property (True ends the episode after the turn's calls)."
            )
        toolbox = self._toolbox(probe)
        if not toolbox.names:
            raise ValueError(
                f"{field}: {self.class_path} has no tool methods; give it at least one public method "
                "with type hints and a Google-style docstring for the model to call."
            )
        self.tool_names = toolbox.names

    def new(self, row: dict) -> tuple[object, str | None, Toolbox]:
        """A fresh instance reset for ``row``.

        Returns:
            The instance, the text its ``reset`` returned (None for nothing to
            add), and a :class:`Toolbox` of its bound tool methods.

        Raises:
            ValueError: ``reset`` raised or returned something that is not a
                str or None; the message names the class, the row and the error.
        """
        instance = self._instance()
        try:
            text = instance.reset(**row)
        except Exception as error:
            raise ValueError(
                f"{self.field}: {self.class_path}.reset raised {type(error).__name__}: {error} "
                f"on row {_short(row)}; fix the row or the environment's reset."
            ) from error
        if text is not None and not isinstance(text, str):
            raise ValueError(
                f"{self.field}: {self.class_path}.reset returned a {type(text).__name__} on row "
                f"{_short(row)}; expected the text to append to the prompt, or None."
            )
        return instance, text, self._toolbox(instance)

    def check(self, rows: Sequence[dict]) -> None:
        """Resets a fresh instance on every row, so a failing ``reset`` stops the run before training.

        Raises:
            ValueError: As :meth:`new`, for the first row that fails.
        """
        for row in rows:
            self.new(row)

    def _instance(self) -> object:
        try:
            return self.make(**self.init_args)
        except Exception as error:
            raise ValueError(
                f"{self.field}: {self.class_path}(**{self.init_args!r}) raised "
                f"{type(error).__name__}: {error}; check {self.field}.init_args."
            ) from error

    def _toolbox(self, instance: object) -> Toolbox:
        # Read names off the class, so building the toolbox evaluates no property of the instance.
        methods = [
            getattr(instance, name)
            for name, _ in inspect.getmembers(self.cls, inspect.isfunction)
            if not name.startswith("_") and name not in _RESERVED
        ]
        return Toolbox(methods, timeout=self.timeout, field=f"{self.field} ({self.class_path} tool methods)")


def _short(row: dict, limit: int = 200) -> str:
    text = repr(row)
    return text if len(text) <= limit else text[:limit] + "...}"


# The column an environment's get_reward() reaches the `environment` reward in.
ENVIRONMENT_REWARD = "environment_reward"


def environment_rewards(environments: list) -> list[float | None]:
    """Each episode's ``get_reward()`` (``None`` where the episode has no environment, or one without
    ``get_reward``).

    Raises:
        ValueError: A ``get_reward()`` returned something that is not a finite number.
    """
    return [
        _environment_reward(env, row) if callable(getattr(env, "get_reward", None)) else None
        for row, env in enumerate(environments)
    ]


def _environment_reward(environment, row: int) -> float:
    name = f"{type(environment).__module__}.{type(environment).__qualname__}.get_reward()"
    try:
        value = environment.get_reward()
    except Exception as error:
        raise ValueError(
            f"{name} raised {error!r} on row {row}; its traceback is above. Fix the "
            "environment: get_reward() must return the finished episode's reward."
        ) from error
    if not isinstance(value, numbers.Real) and not (isinstance(value, torch.Tensor) and value.numel() == 1):
        raise ValueError(
            f"{name} returned {value!r} ({type(value).__name__}) on row {row}; expected a number "
            "(the episode's reward: return 0.0 for an episode that earned nothing)."
        )
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} returned {float(value)} on row {row}; expected a finite number.")
    return float(value)
