"""How the model writes tool calls and how their results are shown to it.

Two formats, picked per tokenizer by :func:`call_format`:

* :class:`TemplateFormat`, where the chat template renders ``tools``
  (Qwen2.5/3, Llama 3.x, Hermes-style templates). A probe learns the
  template's own call syntax: it renders an assistant message carrying one
  ``tool_calls`` entry and reads the text around the JSON object (Qwen:
  ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``; Llama 3.x: a
  bare ``{"name": .., "parameters": {..}}`` that ends the turn). Tools are
  described by the template (``apply_chat_template(tools=...)``) and results
  are rendered as its ``tool`` messages.
* :class:`HermesFormat` otherwise (the embedded SmolLM2, whose template
  ignores ``tools``): calls are ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``,
  tools are listed in a system message (:data:`HERMES_SYSTEM`, the JSON
  schemas inside ``<tools></tools>``, as in NousResearch's Hermes prompt),
  and each result is a ``tool`` message holding
  ``<tool_response>...</tool_response>``; a template that refuses or drops a
  ``tool`` role gets a ``user`` message instead.

Results are rendered by delta: the conversation with the assistant turn
(``[..., assistant]``) and with the tool messages after it
(``[..., assistant, tool..., <generation header>]``) differ only in a
suffix, which is what the episode loop appends. The suffix starts with the
assistant's end-of-turn marker when the template writes one after the turn's
``stop`` text (Hermes: ``<|im_end|>\\n``): generation stopped at ``stop``, so
the model never sampled it.
"""

from __future__ import annotations

import json
import re
from typing import Protocol

from lit_grpo.environments.toolbox import ToolCall, ToolResult

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Here are the available "
    "tools: <tools>\n{tools}\n</tools>\nFor each function call, return a JSON object with the function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_SENTINEL = "\x00lit_grpo-turn\x00"
_PROBE_TOOL = "lit_grpo_probe_tool"
_PROBE_ARGS = {"lit_grpo_probe_arg": "lit_grpo_probe_value"}
_PROBE_SCHEMA = {
    "type": "function",
    "function": {
        "name": _PROBE_TOOL,
        "description": "A probe.",
        "parameters": {
            "type": "object",
            "properties": {"lit_grpo_probe_arg": {"type": "string"}},
            "required": ["lit_grpo_probe_arg"],
        },
    },
}
_PROBE_USER = {"role": "user", "content": "lit_grpo probe question"}


class CallFormat(Protocol):
    """How tool calls are written by the model and how results are shown to it.

    Attributes:
        stop: Text that ends a tool-calling turn (generation stops there).
    """

    stop: str

    def parse(self, text: str) -> list[ToolCall] | str:
        """The calls in one assistant turn's text; ``[]`` when none; a str is an error observation."""

    def system_prompt(self, tokenizer, messages: list[dict], tools: list[dict]) -> list[dict]:
        """The prompt ``messages`` with ``tools`` (JSON schemas) described to the model.

        Render the result with ``apply_chat_template(messages, tools=tools,
        add_generation_prompt=True)`` whatever the format: the template-native
        one leaves the description to the template's ``tools`` block.
        """

    def results_text(self, tokenizer, results: list[ToolResult]) -> str:
        """The text appended after a turn that ended at ``stop``: tool messages + generation header."""


class _JsonCalls:
    """Parsing shared by both formats: JSON objects between ``opener`` and ``closer``."""

    def __init__(self, opener: str, closer: str, arguments_key: str) -> None:
        self.opener, self.closer, self.arguments_key = opener, closer, arguments_key
        self._blocks = re.compile(re.escape(opener) + r"(.*?)" + re.escape(closer), re.DOTALL) if opener else None

    def parse(self, text: str) -> list[ToolCall] | str:
        """Every call in ``text`` in order; an error text for the first malformed one."""
        if self._blocks is not None:
            bodies = self._blocks.findall(text)
            if not bodies and self.opener in text:  # an opened call that never closed
                bodies = [text.split(self.opener, 1)[1]]
        else:
            bodies = _bare_json_objects(text, self.arguments_key)
        calls = []
        for body in bodies:
            call = self._decode(body.strip())
            if isinstance(call, str):
                return call
            calls.append(call)
        return calls

    def _decode(self, body: str) -> ToolCall | str:
        example = f'{self.opener}{{"name": "...", "{self.arguments_key}": {{...}}}}{self.closer}'
        try:
            value = json.loads(body)
        except json.JSONDecodeError as error:
            return f"Error: the tool call is not valid JSON ({error.msg} at char {error.pos}); write {example}"
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return f'Error: the tool call has no "name"; write {example}'
        arguments = value.get(self.arguments_key, value.get("arguments", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            return f'Error: the "{self.arguments_key}" of the tool call must be a JSON object; write {example}'
        return ToolCall(value["name"], arguments)


class HermesFormat(_JsonCalls):
    """``<tool_call>{"name": .., "arguments": {..}}</tool_call>``, tools in a system message.

    For templates that do not render ``tools`` (see the module docstring).
    """

    stop = "</tool_call>"

    def __init__(self) -> None:
        super().__init__("<tool_call>", "</tool_call>", "arguments")

    def system_prompt(self, tokenizer, messages: list[dict], tools: list[dict]) -> list[dict]:
        """Prepends :data:`HERMES_SYSTEM` (with the schemas) to the system message, or adds one."""
        if not tools:
            return list(messages)
        text = HERMES_SYSTEM.format(tools="\n".join(json.dumps(schema) for schema in tools))
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": f"{text}\n\n{messages[0]['content']}"}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def results_text(self, tokenizer, results: list[ToolResult]) -> str:
        """Each result as ``<tool_response>...</tool_response>`` in a tool (or user) message."""
        role = _result_role(tokenizer)
        messages = [
            {"role": role, "name": r.name, "content": f"<tool_response>\n{r.content}\n</tool_response>"}
            for r in results
        ]
        return _suffix(tokenizer, self.stop, messages)


class TemplateFormat(_JsonCalls):
    """The chat template's own call syntax, tool descriptions and tool messages.

    Args:
        opener: Text before a call's JSON object (``<tool_call>``; empty for Llama 3.x).
        closer: Text after it (``</tool_call>``; empty for Llama 3.x).
        arguments_key: The JSON key of the arguments (``arguments``, Llama's ``parameters``).
        stop: Text that ends a tool-calling turn: ``closer``, or the template's
            end-of-turn text when the call has no closer.
    """

    def __init__(self, opener: str, closer: str, arguments_key: str, stop: str) -> None:
        super().__init__(opener, closer, arguments_key)
        self.stop = stop

    def system_prompt(self, tokenizer, messages: list[dict], tools: list[dict]) -> list[dict]:
        """The messages unchanged: render them with ``apply_chat_template(messages, tools=tools)``."""
        return list(messages)

    def results_text(self, tokenizer, results: list[ToolResult]) -> str:
        """The results as the template's ``tool`` messages, then the generation header."""
        messages = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
        return _suffix(tokenizer, self.stop, messages)


def call_format(tokenizer) -> CallFormat:
    """The template's own format when it renders ``tools`` (a probe tells), else :class:`HermesFormat`."""
    try:
        described = tokenizer.apply_chat_template([_PROBE_USER], tools=[_PROBE_SCHEMA], tokenize=False)
    except Exception:  # a template without tool support may raise on the keyword
        return HermesFormat()
    if _PROBE_TOOL not in described:
        return HermesFormat()
    return _learn_template_format(tokenizer) or HermesFormat()


def _learn_template_format(tokenizer) -> TemplateFormat | None:
    """Reads the template's call syntax off its rendering of one probe call; None if it is unreadable."""
    call = {"type": "function", "function": {"name": _PROBE_TOOL, "arguments": _PROBE_ARGS}}
    try:
        with_call = _render(tokenizer, [_PROBE_USER, {"role": "assistant", "content": "", "tool_calls": [call]}])
        with_text = _render(tokenizer, [_PROBE_USER, {"role": "assistant", "content": _SENTINEL}])
    except Exception:
        return None
    head, _, turn_end = with_text.partition(_SENTINEL)
    if not head or not with_call.startswith(head):
        return None
    written = with_call[len(head) :]
    start = written.find("{")
    try:
        value, end = json.JSONDecoder().raw_decode(written, start)
    except (ValueError, json.JSONDecodeError):
        return None
    keys = [key for key, item in value.items() if item == _PROBE_ARGS] if isinstance(value, dict) else []
    if value.get("name") != _PROBE_TOOL or not keys:
        return None
    tail, marker = written[end:], turn_end.strip()  # the closer, then the template's end of turn
    opener, closer = written[:start].strip(), (tail.split(marker, 1)[0] if marker else tail).strip()
    stop = closer or turn_end.strip() or tokenizer.eos_token
    return TemplateFormat(opener, closer, keys[0], stop)


def _bare_json_objects(text: str, arguments_key: str) -> list[str]:
    """JSON objects in ``text`` that look like calls (a "name" and ``arguments_key``), as source text."""
    decoder, found, i = json.JSONDecoder(), [], text.find("{")
    while i != -1:
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            continue
        if isinstance(value, dict) and "name" in value and (arguments_key in value or "arguments" in value):
            found.append(text[i:end])
        i = text.find("{", end)
    return found


def _render(tokenizer, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _result_role(tokenizer) -> str:
    """``tool`` when the template renders a tool message's content, else ``user``."""
    try:
        text = _render(
            tokenizer, [_PROBE_USER, {"role": "assistant", "content": "x"}, {"role": "tool", "content": _SENTINEL}]
        )
    except Exception:  # e.g. "Conversation roles must alternate user/assistant"
        return "user"
    return "tool" if _SENTINEL in text else "user"


def _suffix(tokenizer, stop: str, messages: list[dict]) -> str:
    """The text after an assistant turn that ended at ``stop``, up to the next generation header."""
    turn = {"role": "assistant", "content": _SENTINEL}
    full = _render(tokenizer, [_PROBE_USER, turn, *messages], add_generation_prompt=True)
    after = full.split(_SENTINEL, 1)[1]
    return after[len(stop) :] if after.startswith(stop) else after
