"""Tools and multi-turn environments for agentic episodes (TRL's ``tools=`` / ``environment_factory=`` conventions).

* :mod:`~lit_grpo.environments.toolbox`: :class:`ToolCall`, :class:`ToolResult`,
  :class:`Toolbox` (schemas, checked calls under a timeout) and :func:`run_concurrently`.
* :mod:`~lit_grpo.environments.formats`: how calls are written and results shown
  (:func:`call_format` picks the chat template's own format or :class:`HermesFormat`).
* :mod:`~lit_grpo.environments.factory`: the :class:`Environment` protocol and
  :class:`EnvironmentFactory` (one instance per episode, checked before training).
* :mod:`~lit_grpo.environments.builtin`: ``calculator``, ``python`` and the
  ``GuessNumber`` game.
"""

from lit_grpo.environments.factory import Environment, EnvironmentFactory
from lit_grpo.environments.formats import CallFormat, HermesFormat, TemplateFormat, call_format
from lit_grpo.environments.toolbox import Toolbox, ToolCall, ToolResult, run_concurrently

__all__ = [
    "CallFormat",
    "Environment",
    "EnvironmentFactory",
    "HermesFormat",
    "TemplateFormat",
    "ToolCall",
    "ToolResult",
    "Toolbox",
    "call_format",
    "run_concurrently",
]
