"""Tools an episode may call, and how their calls run.

A tool is a plain Python callable with type hints and a Google-style
docstring, the convention of TRL's ``GRPOTrainer(tools=...)``:
:func:`transformers.utils.get_json_schema` turns it into the JSON schema the
chat template shows the model. A :class:`Toolbox` holds one episode's tools,
checks each call the model wrote against the tool's signature, runs it under a
wall-clock timeout, and turns whatever happened into a :class:`ToolResult`
whose ``content`` is the text the model reads next. Nothing a tool does stops
the run: an unknown name, bad arguments, an exception, a hang past the timeout
or a return value that is not text all become an error observation (as in TRL,
which shows ``{"error": str(e)}``), counted by the ``error`` / ``timed_out``
flags.

Return values: ``str`` is used as is; ``int``, ``float``, ``bool``, ``dict``
and ``list`` are written as JSON (``json.dumps``, so ``True`` reads ``true``
and ``{"a": 1}`` stays parseable); anything else (``None``, bytes, an object)
is an error observation naming the type, because its ``str()`` is rarely
text a model can use.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

# JSON-schema types get_json_schema writes for simple hints -> the Python values a call may carry.
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


@dataclass
class ToolCall:
    """One call the model wrote.

    Attributes:
        name: The tool's name.
        arguments: Keyword arguments, as decoded from the call's JSON.
    """

    name: str
    arguments: dict


@dataclass
class ToolResult:
    """What one call returned, as the text the model will read.

    Attributes:
        name: The tool's name as the model wrote it.
        content: The observation; an error text when the call failed.
        error: The call failed: it raised, named an unknown tool, was
            malformed, had bad arguments, timed out, or returned no text.
        timed_out: The call ran past the toolbox's timeout.
        seconds: Wall-clock time the call took.
    """

    name: str
    content: str
    error: bool = False
    timed_out: bool = False
    seconds: float = 0.0


class Toolbox:
    """The tools one episode may call (callables with type hints + Google docstring).

    Args:
        tools: The callables, functions or bound methods; each one's name
            (``__name__``) is the name the model calls it by.
        timeout: Wall-clock seconds one call may run before it is abandoned.
        field: How error messages name the configuration entry (``data.episodes.tools``).

    Raises:
        ValueError: A tool without type hints or docstring, a name used twice,
            or a timeout that is not positive; the message names ``field[i]``.
    """

    def __init__(self, tools: Sequence[Callable], *, timeout: float = 10.0, field: str = "tools") -> None:
        if not timeout > 0:
            raise ValueError(f"{field}: tool timeout={timeout!r}; expected a number of seconds > 0.")
        self.timeout = float(timeout)
        self.tools: dict[str, Callable] = {}
        self.schemas: list[dict] = []
        for i, tool in enumerate(tools):
            schema = tool_schema(tool, f"{field}[{i}]")
            name = schema["function"]["name"]
            if name in self.tools:
                raise ValueError(f"{field}[{i}]: a second tool named {name!r}; tool names must be unique.")
            self.tools[name] = tool
            self.schemas.append(schema)

    @classmethod
    def from_config(
        cls, entries: Sequence[str | Callable], *, timeout: float = 10.0, field: str = "data.episodes.tools"
    ) -> Toolbox:
        """Tools given as callables (TRL's ``tools=[...]``; sync or ``async def``) or dotted paths, e.g.
        ``"lit_grpo.environments.builtin.calculator"``.

        Raises:
            ValueError: A path that does not import or does not name a callable,
                or a tool without type hints or docstring; the message names
                ``field[i]``, the entry and what to fix.
        """
        tools = []
        for i, entry in enumerate(entries):
            tool = import_object(entry, f"{field}[{i}]") if isinstance(entry, str) else entry
            if not callable(tool):
                raise ValueError(
                    f"{field}[{i}]={entry!r} is a {type(tool).__name__}, not a callable; "
                    "give a function with type hints and a Google-style docstring, or its dotted path."
                )
            tools.append(tool)
        return cls(tools, timeout=timeout, field=field)

    @property
    def names(self) -> list[str]:
        """The tool names, in order."""
        return list(self.tools)

    def merged(self, other: Toolbox) -> Toolbox:
        """This toolbox's tools followed by ``other``'s, under this toolbox's timeout."""
        return Toolbox([*self.tools.values(), *other.tools.values()], timeout=self.timeout)

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Runs one episode's calls in order (a stateful environment sees them as written).

        Each call gets the full timeout; a call that hangs is abandoned (see
        :func:`run_concurrently`) and the next one still runs.
        """
        return [self._run_one(call) for call in calls]

    def _run_one(self, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(
                call.name,
                f"Error: unknown tool {call.name!r}; the available tools are {', '.join(self.names) or '(none)'}.",
                error=True,
            )
        problem = _argument_problem(tool, self.schemas[self.names.index(call.name)], call.arguments)
        if problem:
            return ToolResult(call.name, f"Error: bad arguments for {call.name}: {problem}", error=True)
        return _call_with_timeout(tool, call, self.timeout)


def run_concurrently(jobs: Sequence[tuple[Toolbox, Sequence[ToolCall]]]) -> list[list[ToolResult]]:
    """Runs the tool calls of different episodes concurrently, each under its toolbox's timeout.

    One pool thread per episode runs that episode's calls in order; each call
    itself runs in a fresh daemon thread that the pool thread waits on for at
    most the timeout. A call still running then is **abandoned**, not killed
    (Python cannot stop a thread): its result is
    ``ToolResult(timed_out=True, error=True, content="... timed out after Ns")``,
    the episode loop goes on, and the hung thread keeps whatever it holds
    (CPU, locks, the environment instance) until it returns or the process
    exits (daemon threads do not block exit). Tools that can hang for good
    belong in a subprocess, as the built-in ``python`` tool does.

    Args:
        jobs: ``(toolbox, calls)`` per episode; an episode with no calls costs nothing.

    Returns:
        The results per episode, in the order of ``jobs`` and of each episode's calls.
    """
    busy = [i for i, (_, calls) in enumerate(jobs) if calls]
    results: list[list[ToolResult]] = [[] for _ in jobs]
    if not busy:
        return results
    with ThreadPoolExecutor(len(busy), thread_name_prefix="lit_grpo-tools") as pool:
        for i, episode in zip(busy, pool.map(lambda i: jobs[i][0].run(jobs[i][1]), busy)):
            results[i] = episode
    return results


def tool_schema(tool: Callable, where: str) -> dict:
    """The JSON schema of ``tool``, or a ValueError that names ``where`` and what to fix."""
    try:
        return get_json_schema(tool)
    except Exception as error:  # transformers' Docstring/TypeHintParsingException, and odd callables
        name = getattr(tool, "__qualname__", repr(tool))
        raise ValueError(
            f"{where}: tool {name} has no usable schema ({error}); a tool needs a type hint on every "
            "argument and a Google-style docstring with a description and an 'Args:' entry per argument."
        ) from error


def import_object(path: str, where: str) -> Any:
    """Imports ``package.module.name``, or raises a ValueError naming ``where`` and ``path``."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{where}={path!r} is not a dotted path; expected 'package.module.name'.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"{where}={path!r}: cannot import module {module_name!r} ({error}); "
            "check the spelling and that the package is installed."
        ) from error
    if not hasattr(module, attr):
        raise ValueError(f"{where}={path!r}: module {module_name!r} has no attribute {attr!r}.")
    return getattr(module, attr)


def _argument_problem(tool: Callable, schema: dict, arguments: Any) -> str | None:
    """Why ``arguments`` cannot be passed to ``tool`` (missing, unexpected or mistyped), or None."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}."
    try:
        inspect.signature(tool).bind(**arguments)
    except TypeError as error:
        return f"{error}; expected {_signature_text(schema)}."
    properties = schema["function"]["parameters"].get("properties", {})
    for key, value in arguments.items():
        expected = properties.get(key, {}).get("type")
        allowed = _JSON_TYPES.get(expected) if isinstance(expected, str) else None
        if allowed and (not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool))):
            return f"argument {key!r} must be {expected}, got {json.dumps(value)}; expected {_signature_text(schema)}."
    return None


def _signature_text(schema: dict) -> str:
    function = schema["function"]
    properties = function["parameters"].get("properties", {})
    args = ", ".join(f"{key}: {spec.get('type', 'any')}" for key, spec in properties.items())
    return f"{function['name']}({args})"


def _call_with_timeout(tool: Callable, call: ToolCall, timeout: float) -> ToolResult:
    """Runs one call in a daemon thread and waits at most ``timeout`` seconds for it."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            value = tool(**call.arguments)
            outcome["value"] = asyncio.run(value) if inspect.isawaitable(value) else value  # an async def tool
        except BaseException as error:  # SystemExit / KeyboardInterrupt from a tool must not end the run
            outcome["error"] = error

    start = time.monotonic()
    thread = threading.Thread(target=target, name=f"lit_grpo-tool-{call.name}", daemon=True)
    thread.start()
    thread.join(timeout)
    seconds = time.monotonic() - start
    if thread.is_alive():
        return ToolResult(
            call.name, f"Error: {call.name} timed out after {timeout:g}s.", error=True, timed_out=True, seconds=seconds
        )
    if "error" in outcome:
        error = outcome["error"]
        return ToolResult(call.name, f"Error: {type(error).__name__}: {error}", error=True, seconds=seconds)
    text = _as_text(outcome["value"])
    if text is None:
        kind = type(outcome["value"]).__name__
        return ToolResult(call.name, f"Error: {call.name} returned {kind}, not text.", error=True, seconds=seconds)
    return ToolResult(call.name, text, seconds=seconds)


def _as_text(value: Any) -> str | None:
    """``value`` as observation text (str as is, JSON for numbers/bools/dicts/lists), or None."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float, dict, list)):
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):  # a dict holding objects, a circular list
            return None
    return None
