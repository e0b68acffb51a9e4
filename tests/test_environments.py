"""Toolbox (schemas, checked calls, timeouts, concurrency) and the call formats on real chat templates."""

from __future__ import annotations

import threading
import time

import pytest

from lit_grpo.environments import (
    HermesFormat,
    TemplateFormat,
    Toolbox,
    ToolCall,
    call_format,
    run_concurrently,
)


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def no_hints(a, b):
    """Adds.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def no_docstring(a: int) -> int:
    return a


def nap(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def returns(kind: str):
    """Returns a value of the named kind.

    Args:
        kind: Which value.
    """
    return {
        "int": 3,
        "float": 0.5,
        "bool": True,
        "dict": {"a": [1, "b"]},
        "none": None,
        "object": object(),
        "bytes": b"x",
        "unserialisable": {"a": object()},
    }[kind]


def fails(message: str) -> str:
    """Raises.

    Args:
        message: The error's message.
    """
    raise KeyError(message)


def _hanging_tool(release: threading.Event):
    """A tool that blocks until ``release`` is set (or its argument's seconds pass)."""

    def hang(seconds: float) -> str:
        """Hangs.

        Args:
            seconds: At most this long.
        """
        release.wait(seconds)
        return "woke"

    return hang


# --------------------------------------------------------------------------- Toolbox
def test_schema_of_a_typed_tool_is_transformers_json_schema():
    toolbox = Toolbox([add, nap])
    assert toolbox.names == ["add", "nap"]
    assert toolbox.schemas[0] == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Adds two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first addend."},
                    "b": {"type": "integer", "description": "The second addend."},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "integer"},
        },
    }


@pytest.mark.parametrize(
    "path, expected",
    [
        ("no_such_package_xyz.tool", "cannot import module 'no_such_package_xyz'"),
        (f"{__name__}.missing", "has no attribute 'missing'"),
        (f"{__name__}.threading", "not a callable"),
        (f"{__name__}.no_hints", "type hint"),
        (f"{__name__}.no_docstring", "docstring"),
        ("calculator", "not a dotted path"),
    ],
)
def test_from_config_errors_name_the_field_and_the_path(path, expected):
    with pytest.raises(ValueError) as error:
        Toolbox.from_config([f"{__name__}.add", path])
    assert "data.episodes.tools[1]" in str(error.value)
    assert expected in str(error.value)
    assert path.rsplit(".", 1)[-1] in str(error.value)


def test_from_config_imports_in_order_and_refuses_a_name_twice():
    toolbox = Toolbox.from_config(["lit_grpo.environments.builtin.calculator", f"{__name__}.add"])
    assert toolbox.names == ["calculator", "add"]
    with pytest.raises(ValueError, match=r"data.episodes.tools\[1\]: a second tool named 'add'"):
        Toolbox.from_config([f"{__name__}.add", f"{__name__}.add"])


def test_calls_run_in_order_and_failures_become_error_observations():
    toolbox = Toolbox([add, fails])
    ok, unknown, mistyped, missing, extra, raised = toolbox.run(
        [
            ToolCall("add", {"a": 2, "b": 3}),
            ToolCall("multiply", {"a": 2}),
            ToolCall("add", {"a": "2", "b": 3}),
            ToolCall("add", {"a": 2}),
            ToolCall("add", {"a": 2, "b": 3, "c": 4}),
            ToolCall("fails", {"message": "boom"}),
        ]
    )
    assert (ok.content, ok.error) == ("5", False)
    assert unknown.error and unknown.content == "Error: unknown tool 'multiply'; the available tools are add, fails."
    assert mistyped.error and "argument 'a' must be integer, got \"2\"" in mistyped.content
    assert "expected add(a: integer, b: integer)" in mistyped.content
    assert missing.error and "missing a required argument: 'b'" in missing.content
    assert extra.error and "unexpected keyword argument 'c'" in extra.content
    assert raised.error and raised.content == "Error: KeyError: 'boom'"
    assert not any(r.timed_out for r in (ok, unknown, mistyped, missing, extra, raised))


@pytest.mark.parametrize(
    "kind, content, error",
    [
        ("int", "3", False),
        ("float", "0.5", False),
        ("bool", "true", False),
        ("dict", '{"a": [1, "b"]}', False),
        ("none", "Error: returns returned NoneType, not text.", True),
        ("object", "Error: returns returned object, not text.", True),
        ("bytes", "Error: returns returned bytes, not text.", True),
        ("unserialisable", "Error: returns returned dict, not text.", True),
    ],
)
def test_returns_that_are_not_text(kind, content, error):
    (result,) = Toolbox([returns]).run([ToolCall("returns", {"kind": kind})])
    assert (result.content, result.error) == (content, error)


def test_a_hanging_tool_times_out_and_the_caller_goes_on():
    release = threading.Event()
    hang = _hanging_tool(release)
    toolbox = Toolbox([hang, add], timeout=0.3)
    start = time.monotonic()
    hung, after = toolbox.run([ToolCall("hang", {"seconds": 30}), ToolCall("add", {"a": 1, "b": 1})])
    elapsed = time.monotonic() - start
    release.set()
    assert hung.timed_out and hung.error and hung.content == "Error: hang timed out after 0.3s."
    assert hung.seconds >= 0.3
    assert (after.content, after.timed_out) == ("2", False)  # the next call of the episode still ran
    assert elapsed < 2.0  # 0.3 s timeout, not 30 s


def test_episodes_run_concurrently():
    toolbox = Toolbox([nap])
    start = time.monotonic()
    results = run_concurrently(
        [
            (toolbox, [ToolCall("nap", {"seconds": 1.0})]),
            (toolbox, []),
            (toolbox, [ToolCall("nap", {"seconds": 1.0})]),
        ]
    )
    elapsed = time.monotonic() - start
    assert [[r.content for r in episode] for episode in results] == [["slept 1.0"], [], ["slept 1.0"]]
    assert elapsed < 1.8  # two 1-s calls of different episodes overlap; in series they would take 2 s
    assert run_concurrently([]) == []


def test_a_hung_episode_does_not_hold_up_the_others():
    release = threading.Event()
    hang = _hanging_tool(release)
    start = time.monotonic()
    hung, quick = run_concurrently(
        [
            (Toolbox([hang], timeout=0.5), [ToolCall("hang", {"seconds": 30})]),
            (Toolbox([nap]), [ToolCall("nap", {"seconds": 0.2})]),
        ]
    )
    elapsed = time.monotonic() - start
    release.set()
    assert hung[0].timed_out and quick[0].content == "slept 0.2"
    assert elapsed < 1.5  # the 0.5-s timeout, not the 30-s hang


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="data.episodes.tools: tool timeout=0; expected a number of seconds > 0"):
        Toolbox([add], timeout=0, field="data.episodes.tools")


# --------------------------------------------------------------------------- Hermes parsing
def test_hermes_parses_one_and_two_calls_and_none():
    hermes = HermesFormat()
    one = 'I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert hermes.parse(one) == [ToolCall("add", {"a": 1, "b": 2})]
    two = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "nap", "arguments": "{\\"seconds\\": 0}"}</tool_call>'
    )
    assert hermes.parse(two) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("nap", {"seconds": 0})]
    assert hermes.parse("The answer is 3.") == []
    assert hermes.stop == "</tool_call>"


@pytest.mark.parametrize(
    "text, expected",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {"a": 1}}</tool_call>', 'has no "name"'),
        ('<tool_call>["add"]</tool_call>', 'has no "name"'),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1', "not valid JSON"),  # never closed
    ],
)
def test_hermes_malformed_calls_are_error_observations(text, expected):
    observation = HermesFormat().parse(text)
    assert isinstance(observation, str) and observation.startswith("Error: ")
    assert expected in observation
    assert '<tool_call>{"name": "...", "arguments": {...}}</tool_call>' in observation  # how to write it


# --------------------------------------------------------------------------- chat templates
# A Qwen2.5-style template: tools in the system message, calls in <tool_call> tags, tool results
# as <tool_response> blocks inside one user turn.
QWEN_STYLE = (  # transformers renders templates with trim_blocks: a newline right after a tag is {{ '\n' }}
    "{% if tools %}<|im_start|>system\nYou are helpful.\n\n# Tools\n\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools><|im_end|>{{ '\n' }}"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>{{ '\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\n' }}{% endif %}"
    "{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{% for call in message.tool_calls %}{{ '\n' }}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>{{ '\n' }}"
    "{% elif message.role != 'system' or not loop.first %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>{{ '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A Llama-3.1-style template: a bare {"name", "parameters"} JSON call ends the turn at <|eot_id|>,
# tool results come back in an `ipython` turn.
LLAMA_STYLE = (
    "{% for message in messages %}<|start_header_id|>"
    "{{ 'ipython' if message.role == 'tool' else message.role }}<|end_header_id|>\n\n"
    "{% if loop.first and tools %}Tools:{% for tool in tools %} {{ tool | tojson }}{% endfor %}{{ '\n\n' }}{% endif %}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{% endfor %}{% else %}{{ message.content }}{% endif %}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def smollm_tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_dir)


def _with_template(embedded_dir, template):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)  # a copy: the fixture's keeps SmolLM2's template
    tokenizer.chat_template = template
    return tokenizer


def _episode_and_whole(tokenizer, fmt, turn_text, results, tool_messages, tools, content=None):
    """(the episode text the format builds, the same conversation rendered whole by the template).

    ``turn_text`` is what the model wrote, ending at ``fmt.stop``; ``content`` is that turn as an
    assistant message's content (default: the same text).
    """
    messages = fmt.system_prompt(tokenizer, [{"role": "user", "content": "What is 2 + 3?"}], tools)
    prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    episode = prompt + turn_text + fmt.results_text(tokenizer, results)
    whole = [*messages, {"role": "assistant", "content": turn_text if content is None else content}, *tool_messages]
    return episode, tokenizer.apply_chat_template(whole, tools=tools, tokenize=False, add_generation_prompt=True)


def test_smollm2_gets_hermes_and_its_episode_text_is_the_template_rendering(smollm_tokenizer):
    fmt = call_format(smollm_tokenizer)
    assert isinstance(fmt, HermesFormat)
    toolbox = Toolbox([add])
    call_text = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    calls = fmt.parse(call_text)
    results = toolbox.run(calls) + toolbox.run([ToolCall("sub", {})])
    tool_messages = [{"role": "tool", "content": f"<tool_response>\n{r.content}\n</tool_response>"} for r in results]
    episode, whole = _episode_and_whole(smollm_tokenizer, fmt, call_text, results, tool_messages, toolbox.schemas)
    assert episode == whole
    assert fmt.results_text(smollm_tokenizer, results[:1]) == (
        "<|im_end|>\n<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    system = fmt.system_prompt(smollm_tokenizer, [{"role": "system", "content": "Be brief."}], toolbox.schemas)
    assert '"name": "add"' in system[0]["content"] and system[0]["content"].endswith("\n\nBe brief.")


def test_a_template_without_a_tool_role_gets_results_as_a_user_message(embedded_dir):
    strict = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant', 'system'] %}"
        "{{ raise_exception('Conversation roles must be user/assistant/system') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer = _with_template(embedded_dir, strict)
    fmt = call_format(tokenizer)
    results = Toolbox([add]).run([ToolCall("add", {"a": 2, "b": 3})])
    assert fmt.results_text(tokenizer, results) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_qwen_style_template_is_used_natively(embedded_dir):
    tokenizer = _with_template(embedded_dir, QWEN_STYLE)
    fmt = call_format(tokenizer)
    assert isinstance(fmt, TemplateFormat)
    assert (fmt.opener, fmt.closer, fmt.arguments_key, fmt.stop) == (
        "<tool_call>",
        "</tool_call>",
        "arguments",
        "</tool_call>",
    )
    toolbox = Toolbox([add])
    # What the model writes is what the template renders for a structured call.
    structured = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
    ]
    rendered = tokenizer.apply_chat_template(structured, tokenize=False)
    call_text = rendered.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    calls = fmt.parse(call_text)
    assert calls == [ToolCall("add", {"a": 2, "b": 3})]
    results = toolbox.run(calls * 2)
    tool_messages = [{"role": "tool", "content": r.content} for r in results]
    episode, whole = _episode_and_whole(tokenizer, fmt, call_text, results, tool_messages, toolbox.schemas)
    assert episode == whole
    assert fmt.results_text(tokenizer, results) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n5\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert fmt.system_prompt(tokenizer, structured[:1], toolbox.schemas) == structured[:1]  # the template lists them


def test_a_llama_style_template_is_used_natively(embedded_dir):
    tokenizer = _with_template(embedded_dir, LLAMA_STYLE)
    fmt = call_format(tokenizer)
    assert isinstance(fmt, TemplateFormat)
    assert (fmt.opener, fmt.closer, fmt.arguments_key, fmt.stop) == ("", "", "parameters", "<|eot_id|>")
    toolbox = Toolbox([add])
    call_text = 'Sure. {"name": "add", "parameters": {"a": 2, "b": 3}} {"not": "a call"}<|eot_id|>'
    calls = fmt.parse(call_text)
    assert calls == [ToolCall("add", {"a": 2, "b": 3})]
    results = toolbox.run(calls)
    assert fmt.results_text(tokenizer, results) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # The model sampled the turn's <|eot_id|> (its stop); the results do not repeat it.
    episode, whole = _episode_and_whole(
        tokenizer,
        fmt,
        call_text,
        results,
        [{"role": "tool", "content": "5"}],
        toolbox.schemas,
        content=call_text.removesuffix(fmt.stop),
    )
    assert episode == whole
