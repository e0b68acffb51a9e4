"""The reward protocol and the combiner that turns several rewards into one.

A reward function is any callable
``f(prompts: list[str], completions: list[str], **columns) -> list[float | None]``:
``columns`` are the batch's other dataset columns as lists (the same calling
convention as TRL's ``GRPOTrainer``, so its reward functions port unchanged)
and ``None`` means "does not apply to this row". A function may also name
what TRL passes beside them (:data:`SUPPLIED`): ``completion_ids`` (each
completion's token ids), ``environments`` (each episode's environment
instance, ``None`` without one), ``trainer_state`` (:class:`TrainerState`:
global step, epoch, max steps) and ``log_metric(name, value)`` (a number
logged with the rollout's statistics); one that takes ``**kwargs`` gets them
all. ``async def`` rewards are awaited, all of a batch's concurrently. The
combiner calls each function once per batch, checks what it returned, and
forms the weighted sum of the applicable values per row.
"""

from __future__ import annotations

import abc
import asyncio
import importlib
import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch

RewardFn = Callable[..., Sequence[float | None]]

# What a reward function may name beside the rows' columns, as TRL's GRPOTrainer passes them.
SUPPLIED = ("prompts", "completions", "completion_ids", "environments", "trainer_state", "log_metric")


@dataclass(frozen=True)
class TrainerState:
    """Where training is, for rewards that change with it (curricula): TRL's ``trainer_state``.

    Attributes:
        global_step: Optimizer steps taken so far.
        epoch: The current epoch.
        max_steps: Optimizer steps the run will take, ``-1`` where unknown.
    """

    global_step: int
    epoch: int
    max_steps: int = -1


class Reward(abc.ABC):
    """A reward with its weight, configurable from YAML by ``class_path``.

    Calling an instance returns the raw (unweighted) values; the
    :class:`RewardCombiner` applies ``weight``.

    Args:
        weight: Multiplier of this reward in the total.
        name: Key of this reward in logs; default: the subclass's built-in name.
    """

    default_name: str = "reward"
    # Dataset columns the reward reads: checked against the data before any sampling.
    required_columns: tuple[str, ...] = ()
    # Names of SUPPLIED beyond prompts and completions that __call__ reads (passed as keyword arguments).
    extra_arguments: tuple[str, ...] = ()

    def __init__(self, weight: float = 1.0, name: str | None = None) -> None:
        if not math.isfinite(weight):
            raise ValueError(f"Reward weight must be a finite number, got {weight!r}")
        self.weight = float(weight)
        self.name = name or self.default_name

    @abc.abstractmethod
    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        """Scores each completion; ``None`` where the reward does not apply."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, weight={self.weight})"


class FromCallable(Reward):
    """Wraps a reward function named by its dotted import path.

    Args:
        function: ``"package.module.function"``; a bare name (``"accuracy"``)
            means a built-in from :mod:`lit_grpo.rewards`.
        weight: Multiplier of this reward in the total.
        name: Key in logs; default: the function's ``__name__``.
    """

    def __init__(self, function: str, weight: float = 1.0, name: str | None = None) -> None:
        self.function = import_reward(function)
        super().__init__(weight, name or getattr(self.function, "__name__", function))

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        return self.function(prompts=prompts, completions=completions, **columns)


def import_reward(path: str) -> RewardFn:
    """Imports ``pkg.mod.fn`` (or a built-in's bare name) and checks it is callable."""
    if "." not in path:
        from lit_grpo import rewards  # bare names are the built-ins

        if path not in rewards.BUILTINS:
            raise ValueError(
                f"Unknown reward {path!r}: give a dotted path 'package.module.function' "
                f"or one of the built-ins {sorted(rewards.BUILTINS)}"
            )
        return rewards.BUILTINS[path]
    module_name, attr = path.rsplit(".", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"Cannot import module {module_name!r} for reward {path!r}: {e}") from e
    function = getattr(module, attr, None)
    if function is None:
        raise ImportError(f"Module {module_name!r} has no attribute {attr!r} (reward {path!r})")
    if not callable(function):
        raise TypeError(f"Reward {path!r} is a {type(function).__name__}, not a callable")
    return function


@dataclass(frozen=True)
class RewardScores:
    """Rewards of one batch.

    Attributes:
        total: ``[N]`` float32, weighted sum of the applicable values (0 where none apply).
        per_function: name -> ``[N]`` float32 raw values, NaN where not applicable.
    """

    total: torch.Tensor
    per_function: dict[str, torch.Tensor]


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names it and the failing row."""


class RewardCombiner:
    """Calls every reward on a batch and forms the weighted total per row.

    Args:
        rewards: :class:`Reward` instances (weight and name their own), plain
            callables (weight 1, named by ``__name__``) or ``(callable, weight)`` pairs.
        on_error: ``"raise"``: a reward that raises stops training with an
            error naming it and the row; ``"zero"``: it scores 0 for that
            batch and a warning is emitted once per reward.
    """

    def __init__(
        self,
        rewards: Sequence[Reward | RewardFn | tuple[RewardFn, float]],
        on_error: Literal["raise", "zero"] = "raise",
    ) -> None:
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
        if not rewards:
            raise ValueError("RewardCombiner needs at least one reward")
        self.on_error = on_error
        self.entries = [_entry(r) for r in rewards]  # [(name, fn, weight)]
        names = [name for name, _, _ in self.entries]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"Reward names must be unique, got {duplicates} twice; set `name`")
        self._warned: set[str] = set()

    def check_columns(self, available: Sequence[str], source: str) -> None:
        """Raise before any sampling if a reward needs a dataset column that ``source`` lacks, or
        names an argument that is neither a column nor one of :data:`SUPPLIED`."""
        for name, fn, _ in self.entries:
            named, _ = _parameters(fn)
            unknown = [a for a, required in named.items() if required and a not in SUPPLIED and a not in available]
            if unknown:
                raise ValueError(
                    f"Reward {name!r} takes the argument {unknown[0]!r}, which lit_grpo cannot supply: a reward "
                    f"may take {', '.join(SUPPLIED)} and the columns of data.source.dataset={source!r} "
                    f"({', '.join(sorted(available))}); give {unknown[0]!r} a default, or map a column to it "
                    "with data.source.columns."
                )
            missing = [c for c in getattr(fn, "required_columns", ()) if c not in available]
            if missing:
                raise ValueError(
                    f"Reward {name!r} needs the dataset column(s) {missing}, which data.source.dataset={source!r} "
                    f"does not have (available: {sorted(available)}); map them with data.source.columns, "
                    f"e.g. {{{missing[0]!r}: 'your_column'}}, or drop the reward."
                )

    def bind(self, module) -> None:
        """Hand the training module to every reward that runs a model of its own (one with a
        ``bind`` method, e.g. :class:`~lit_grpo.rewards.RewardModel`): it loads onto the policy's device."""
        for _, fn, _ in self.entries:
            if callable(getattr(fn, "bind", None)):
                fn.bind(module)

    @property
    def names(self) -> list[str]:
        """The rewards' names, in order."""
        return [name for name, _, _ in self.entries]

    def score(
        self,
        prompts: list[str],
        completions: list[str],
        columns: dict[str, list],
        supplied: dict[str, Any] | None = None,
    ) -> RewardScores:
        """Scores a batch.

        Args:
            prompts: ``N`` prompts (repeated once per completion of a group).
            completions: ``N`` decoded completions.
            columns: Other per-row columns (e.g. ``answer``, ``completion_length``), each of length ``N``.
            supplied: Values of :data:`SUPPLIED` beyond prompts and completions (``completion_ids``,
                ``environments``, ``trainer_state``, ``log_metric``), each passed to the rewards that
                name it or take ``**kwargs``.

        Returns:
            The weighted totals and the raw values per reward.
        """
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"Got {len(prompts)} prompts for {n} completions")
        for key, values in columns.items():
            if key in ("prompts", "completions"):
                raise ValueError(f"Column name {key!r} clashes with a reward argument")
            if len(values) != n:
                raise ValueError(f"Column {key!r} has {len(values)} rows for {n} completions")
        supplied = supplied or {}
        calls = [(name, fn, {**columns, **_wanted(fn, supplied)}) for name, fn, _ in self.entries]
        # async rewards first, all together; their results (or errors) are then checked in order
        pending = {
            name: fn(prompts=prompts, completions=completions, **kwargs) for name, fn, kwargs in calls if _is_async(fn)
        }
        awaited = dict(zip(pending, _await_all(list(pending.values())))) if pending else {}
        total = torch.zeros(n, dtype=torch.float64)
        per_function = {}
        for (name, fn, kwargs), (_, _, weight) in zip(calls, self.entries):
            values = self._call(name, fn, prompts, completions, kwargs, awaited.get(name, _NOT_RUN))  # [N], NaN=n/a
            applicable = ~torch.isnan(values)
            total += torch.where(applicable, values * weight, torch.zeros_like(values))
            per_function[name] = values.float()
        return RewardScores(total.float(), per_function)

    def _call(
        self, name: str, fn: RewardFn, prompts: list[str], completions: list[str], columns: dict[str, Any], result: Any
    ) -> torch.Tensor:
        try:
            if result is _NOT_RUN:
                result = fn(prompts=prompts, completions=completions, **columns)
            if isinstance(result, BaseException):  # raised while awaited
                raise result
            raw = result
        except Exception as e:
            if self.on_error == "zero":
                if name not in self._warned:
                    self._warned.add(name)
                    warnings.warn(
                        f"Reward {name!r} raised {e!r}; it scores 0 for this batch (on_error='zero'; warned once)",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                return torch.zeros(len(completions), dtype=torch.float64)
            row = _failing_row(fn, prompts, completions, columns)
            where = f"on row {row}" if row is not None else "on the batch (no single row fails)"
            raise RewardFunctionError(
                f"Reward {name!r} raised {where}: {e!r}; its traceback is above. Fix the "
                "function: it is called with prompts, completions and the rows' columns "
                "as keyword arguments."
            ) from e
        return _validate(name, raw, len(completions))


def _entry(reward: Reward | RewardFn | tuple[RewardFn, float]) -> tuple[str, RewardFn, float]:
    if isinstance(reward, tuple):
        fn, weight = reward
        name = fn.name if isinstance(fn, Reward) else _name(fn)
        return name, fn, float(weight)
    if isinstance(reward, Reward):
        return reward.name, reward, reward.weight
    if callable(reward):
        return _name(reward), reward, 1.0
    raise TypeError(f"A reward must be a Reward, a callable or (callable, weight), got {reward!r}")


def _name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _validate(name: str, raw: Any, n: int) -> torch.Tensor:
    """Checks a reward's output and returns it as float64 ``[N]`` with NaN for None."""
    try:
        values = list(raw)
    except TypeError:
        raise ValueError(f"Reward {name!r} returned {raw!r}, expected a list of {n} numbers") from None
    if len(values) != n:
        raise ValueError(f"Reward {name!r} returned {len(values)} values for {n} completions")
    out = torch.empty(n, dtype=torch.float64)
    for i, v in enumerate(values):
        if v is None:
            out[i] = math.nan
            continue
        if not isinstance(v, numbers.Real):
            raise ValueError(
                f"Reward {name!r} returned {v!r} ({type(v).__name__}) on row {i}; expected a number or None"
            )
        if not math.isfinite(v):
            raise ValueError(f"Reward {name!r} returned {v!r} on row {i}; values must be finite")
        out[i] = float(v)
    return out


def _failing_row(fn: RewardFn, prompts: list[str], completions: list[str], columns: dict[str, list]) -> int | None:
    """Re-runs ``fn`` one row at a time to find the first row that raises."""
    for i in range(len(completions)):
        row = {k: v[i : i + 1] if isinstance(v, list) else v for k, v in columns.items()}
        try:
            result = fn(prompts=prompts[i : i + 1], completions=completions[i : i + 1], **row)
            if inspect.isawaitable(result):
                [result] = _await_all([result])
                if isinstance(result, BaseException):
                    raise result
        except Exception:
            return i
    return None


_NOT_RUN = object()  # a reward that was not awaited ahead of the others


def _target(fn: RewardFn):
    """What a reward calls in the end: the function a :class:`Reward` wraps (``FromCallable``,
    episodes' wrappers), or the callable itself."""
    while isinstance(fn, Reward) and callable(getattr(fn, "function", None)):
        fn = fn.function
    return fn


def _parameters(fn: RewardFn) -> tuple[dict[str, bool], bool]:
    """The parameters a reward's function takes by name (name -> whether it must be given: no default),
    and whether it takes ``**kwargs``. A :class:`Reward` without a wrapped function takes its
    ``extra_arguments``."""
    target = _target(fn)
    if isinstance(target, Reward):
        return dict.fromkeys(target.extra_arguments, True), False
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: columns only, as before
        return {}, False
    named = {
        p.name: p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        for p in parameters
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    return named, any(p.kind is p.VAR_KEYWORD for p in parameters)


def _wanted(fn: RewardFn, supplied: dict[str, Any]) -> dict[str, Any]:
    """The values of ``supplied`` that ``fn`` names (all of them for ``**kwargs``)."""
    named, every = _parameters(fn)
    return dict(supplied) if every else {k: v for k, v in supplied.items() if k in named}


def _is_async(fn: RewardFn) -> bool:
    target = _target(fn)
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(getattr(target, "__call__", None))


def _await_all(awaitables: list) -> list:
    """Await ``awaitables`` concurrently: their results, or the exceptions they raised. Runs its own
    event loop in a helper thread, so it also works where a loop is running already (Jupyter)."""

    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather()).result()
