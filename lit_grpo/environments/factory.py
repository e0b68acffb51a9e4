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
from collections.abc import Sequence
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
    """Builds one environment instance per episode from a class_path (+ init args) and checks it early.

    Args:
        class_path: Dotted path of the environment class
            (``lit_grpo.environments.builtin.GuessNumber``).
        init_args: Keyword arguments of the class's constructor.
        field: How error messages name the configuration entry.
        timeout: Wall-clock seconds one tool call may run.

    Raises:
        ValueError: The class does not import, cannot be built from
            ``init_args``, has no ``reset``, has no tool method, a tool
            method lacks type hints or a docstring, or ``done`` (the flag
            that ends an episode) is a method.

    Attributes:
        has_reward: The class defines ``get_reward`` (the environment owns a reward).
        tool_names: The names of its tool methods.
    """

    def __init__(self, class_path: str, init_args: dict | None = None, *, field: str = "data.episodes.environment",
                 timeout: float = 10.0) -> None:
        self.class_path = class_path
        self.init_args = dict(init_args or {})
        self.field = field
        self.timeout = timeout
        self.cls = import_object(class_path, f"{field}.class_path")
        if not inspect.isclass(self.cls):
            raise ValueError(f"{field}.class_path={class_path!r} is a {type(self.cls).__name__}, not a class.")
        if not callable(getattr(self.cls, "reset", None)):
            raise ValueError(f"{field}: {class_path} has no reset(self, **row) method; an environment needs one "
                             "(it may return None).")
        self.has_reward = callable(getattr(self.cls, "get_reward", None))
        if inspect.isfunction(getattr(self.cls, "done", None)):
            raise ValueError(f"{field}: {class_path}.done is a method; make it a boolean attribute or a @property "
                             "(True ends the episode after the turn's calls).")
        probe = self._instance()
        toolbox = self._toolbox(probe)
        if not toolbox.names:
            raise ValueError(f"{field}: {class_path} has no tool methods; give it at least one public method "
                             "with type hints and a Google-style docstring for the model to call.")
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
            raise ValueError(f"{self.field}: {self.class_path}.reset raised {type(error).__name__}: {error} "
                             f"on row {_short(row)}; fix the row or the environment's reset.") from error
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{self.field}: {self.class_path}.reset returned a {type(text).__name__} on row "
                             f"{_short(row)}; expected the text to append to the prompt, or None.")
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
            return self.cls(**self.init_args)
        except Exception as error:
            raise ValueError(f"{self.field}: {self.class_path}(**{self.init_args!r}) raised "
                             f"{type(error).__name__}: {error}; check {self.field}.init_args.") from error

    def _toolbox(self, instance: object) -> Toolbox:
        # Read names off the class, so building the toolbox evaluates no property of the instance.
        methods = [getattr(instance, name) for name, _ in inspect.getmembers(self.cls, inspect.isfunction)
                   if not name.startswith("_") and name not in _RESERVED]
        return Toolbox(methods, timeout=self.timeout, field=f"{self.field} ({self.class_path} tool methods)")


def _short(row: dict, limit: int = 200) -> str:
    text = repr(row)
    return text if len(text) <= limit else text[:limit] + "...}"


# The column an environment's get_reward() reaches the `environment` reward in.
ENVIRONMENT_REWARD = "environment_reward"


def environment_rewards(environments: list) -> list[float | None]:
    """Each episode's ``get_reward()`` (``None`` where the episode has no environment).

    Raises:
        ValueError: A ``get_reward()`` returned something that is not a finite number.
    """
    return [None if env is None else _environment_reward(env, row) for row, env in enumerate(environments)]


def _environment_reward(environment, row: int) -> float:
    name = f"{type(environment).__module__}.{type(environment).__qualname__}.get_reward()"
    try:
        value = environment.get_reward()
    except Exception as error:
        raise ValueError(f"{name} raised {error!r} on row {row}; its traceback is above. Fix the "
                         "environment: get_reward() must return the finished episode's reward.") from error
    if not isinstance(value, numbers.Real) and not (isinstance(value, torch.Tensor) and value.numel() == 1):
        raise ValueError(f"{name} returned {value!r} ({type(value).__name__}) on row {row}; expected a number "
                         "(the episode's reward: return 0.0 for an episode that earned nothing).")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} returned {float(value)} on row {row}; expected a finite number.")
    return float(value)
