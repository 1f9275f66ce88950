"""Tool calls without a model: which syntax a chat template teaches, how tools reach the
prompt, the grammar that forces a valid call, and the parser that reads calls back, whole
or streamed in arbitrary pieces (the two must agree)."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from api_helpers import call_turn, weather_tool
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.sampling.grammar import GrammarCompiler
from tokenmill.server.protocol import NamedToolChoice, Tool
from tokenmill.server.tool_parser import Delta, ToolCallParser, parse_tool_calls
from tokenmill.server.tools import ToolRequest
from tokenmill.tokenizer import Tokenizer
from tokenmill.tokenizer.chat import (
    HERMES,
    LLAMA3,
    MISTRAL,
    as_plain_chat,
    encode_tool_chat,
    prepare_chat,
    renders_tools,
    tool_format,
)
from tokenmill.tokenizer.chat_template import render_chat_template

# Shaped like Qwen2.5's template: tools in the system turn, calls as <tool_call> JSON,
# results as <tool_response> in a user turn.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
LLAMA3_SNIPPET = '{% if tools %}Environment: ipython{% endif %}{{ "<|python_tag|>" }}'
MISTRAL_SNIPPET = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]"
)
MISTRAL_NAMED = MISTRAL_SNIPPET + "{{ name }}[ARGS]{{ arguments }}"  # the newer call form
PLAIN_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

WEATHER = weather_tool("The current weather in a city", city_max_length=20)
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters at all
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(CLOCK)]
VOCAB, EOS = 49152, [0, 2]


def request(template: str | None, choice=None, parallel=None) -> ToolRequest:
    return ToolRequest.create(TOOLS, choice, parallel, template)


# --------------------------------------------------------------------------- formats


def test_the_template_says_which_syntax():
    assert tool_format(HERMES_TEMPLATE) == HERMES and renders_tools(HERMES_TEMPLATE)
    assert tool_format(LLAMA3_SNIPPET) == LLAMA3 and renders_tools(LLAMA3_SNIPPET)
    assert tool_format(MISTRAL_SNIPPET) == MISTRAL and renders_tools(MISTRAL_SNIPPET)
    assert tool_format(PLAIN_CHATML) == HERMES and not renders_tools(PLAIN_CHATML)
    assert tool_format(None) == HERMES and not renders_tools(None)


def test_request_checks():
    assert ToolRequest.create(None, None, None, PLAIN_CHATML) is None
    assert ToolRequest.create(None, "none", None, PLAIN_CHATML) is None
    cases = [
        ((None, "required", None), "tool_choice requires tools"),
        ((None, None, True), "parallel_tool_calls is only allowed"),
        (([], None, None), "tools must not be empty"),
        ((TOOLS + TOOLS[:1], None, None), "defines the function 'get_weather' twice"),
        (
            (
                TOOLS,
                NamedToolChoice.model_validate({"type": "function", "function": {"name": "x"}}),
                None,
            ),
            "tool_choice names the function 'x', which is not among the tools",
        ),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            ToolRequest.create(*args, PLAIN_CHATML)
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    tools = ToolRequest.create(TOOLS, named, None, PLAIN_CHATML)
    assert tools.choice == "function" and tools.forced == "get_time"
    assert request(PLAIN_CHATML).grammar() is None  # "auto" forces nothing
    assert not request(PLAIN_CHATML, "none").parses_calls


# --------------------------------------------------------------------------- the prompt

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    call_turn("call_1", "get_weather", {"city": "Paris", "unit": "celsius"}, content=""),
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
    {"role": "tool", "content": '{"humidity": 40}', "tool_call_id": "call_1"},
]


def test_a_template_with_tools_renders_them_itself():
    messages, tools = request(HERMES_TEMPLATE).template_inputs(HISTORY)
    text = render_chat_template(HERMES_TEMPLATE, messages, tools=tools)
    assert json.dumps(WEATHER) in text and "Be brief." in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text
    messages, tools = request(HERMES_TEMPLATE, "none").template_inputs(HISTORY)
    assert tools is None  # tool_choice "none": the model is not told about them


def test_a_template_without_tools_gets_the_hermes_instructions():
    messages, tools = request(PLAIN_CHATML).template_inputs(HISTORY)
    assert tools is None
    text = render_chat_template(PLAIN_CHATML, messages)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in system and json.dumps(CLOCK) in system
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>' in text
    )
    # both results in one tool turn
    assert (
        '<|im_start|>tool\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
        '<tool_response>\n{"humidity": 40}\n</tool_response><|im_end|>'
    ) in text
    # a history with calls but no tools in this request is still written out
    messages, _ = prepare_chat(HISTORY, None, PLAIN_CHATML)
    assert messages == as_plain_chat(HISTORY, None)
    assert all(set(m) <= {"role", "content"} for m in messages)
    plain = HISTORY[:2]
    assert prepare_chat(plain, None, PLAIN_CHATML) == (plain, None)


def render(template: str):
    """An `encode` for encode_tool_chat that returns the rendered text."""
    return lambda messages, tools: render_chat_template(template, messages, tools=tools)


def test_results_become_a_user_turn_for_templates_that_refuse_tool_turns():
    # shaped like Gemma's: user and model turns only, alternating
    gemma_like = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
        "<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    )
    history = [m for m in HISTORY if m["role"] != "system"]
    text = encode_tool_chat(render(gemma_like), history, None, gemma_like)
    assert '<start_of_turn>user\n<tool_response>\n{"temp": 21}' in text
    chatml = encode_tool_chat(render(PLAIN_CHATML), history, None, PLAIN_CHATML)
    assert chatml.count("<|im_start|>tool\n") == 1
    again = [*history, {"role": "user", "content": "again"}]
    with pytest.raises(ValueError, match="alternate"):  # a refusal for another reason stays one
        encode_tool_chat(render(gemma_like), again, None, gemma_like)


# --------------------------------------------------------------------------- parsing

CASES = [
    (
        HERMES,
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}'
        "\n</tool_call>",
        "Let me check.",
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})],
    ),
    (
        HERMES,
        '<tool_call>\n{"arguments": {"x": "}</tool_call>"}, "name": "f"}\n</tool_call>',
        None,
        [("f", {"x": "}</tool_call>"})],
    ),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1]}"}</tool_call>', None, [("f", {"a": [1]})]),
    (HERMES, "Paris is sunny <tool>, I think.", "Paris is sunny <tool>, I think.", []),
    (HERMES, "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1', '<tool_call>\n{"name": "f", "arguments": {"a": 1', []),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}', None, [("get_weather", {"city": "Oslo", "unit": "celsius"})]),
    (LLAMA3, '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {}}', None, [("a", {"n": 1}), ("b", {})]),
    (LLAMA3, "It is {probably} sunny.", "It is {probably} sunny.", []),
    (MISTRAL, '[TOOL_CALLS] [{"name": "a", "arguments": {"q": "x"}}, {"name": "b", "arguments": {}}]', None, [("a", {"q": "x"}), ("b", {})]),
    (MISTRAL, '[TOOL_CALLS]a[ARGS]{"q": "x"}[TOOL_CALLS]b[ARGS]{}', None, [("a", {"q": "x"}), ("b", {})]),
    (MISTRAL, "No tools needed.", "No tools needed.", []),
]  # fmt: skip


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_parse_whole_output(fmt, text, content, calls):
    got_content, got_calls = parse_tool_calls(fmt, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)
    if fmt == MISTRAL:
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got_calls)


def stream(fmt: str, text: str, cuts: list[int]) -> tuple[Delta, ToolCallParser]:
    parser, total, start = ToolCallParser(fmt), Delta(), 0
    for cut in [*sorted(set(cuts)), len(text)]:
        total.add(parser.feed(text[start:cut]))
        start = cut
    total.add(parser.finish())
    return total, parser


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_streamed_in_any_pieces_equals_whole(case, data):
    fmt, text, content, calls = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    total, parser = stream(fmt, text, cuts)
    if not calls:
        return  # not calls: streamed text is content as far as it went
    assert (total.content.strip() or None) == content
    entries = total.tool_calls
    assert [e["index"] for e in entries] == list(range(len(calls)))
    assert all(e["type"] == "function" and e["id"] for e in entries)
    assert [
        (e["function"]["name"], json.loads(e["function"]["arguments"])) for e in entries
    ] == calls


def test_stream_sends_name_with_the_first_value_then_argument_fragments():
    text = CASES[0][1]
    parser, pieces = ToolCallParser(HERMES), []
    for i in range(0, len(text), 3):
        pieces.append(parser.feed(text[i : i + 3]))
    pieces.append(parser.finish())
    entries = [e for p in pieces for e in p.tool_calls]
    first = entries[0]
    # id and name go out once the arguments' first value begins: until then the call may
    # still turn out to be none ("arguments": "oops", {"x": NaN}, a cut), which a stream
    # cannot take back
    assert first["function"]["name"] == "get_weather" and first["id"]
    assert first["function"]["arguments"].startswith('{"city": "')
    fragments = [e for e in entries if e["index"] == 0 and "id" not in e]
    assert len(fragments) > 3  # arguments arrive as they are written, not at the end
    assert "".join(e["function"]["arguments"] for e in entries if e["index"] == 0) == (
        '{"city": "Paris", "unit": "celsius"}'
    )
    # "<" could start a call: held back, never sent as content
    assert "".join(p.content for p in pieces) == "Let me check.\n"


# --------------------------------------------------------------------------- forced calls


@pytest.fixture(scope="module")
def compiler(smollm_path) -> GrammarCompiler:
    return GrammarCompiler(Tokenizer.from_gguf(smollm_path), VOCAB, EOS)


def walk(compiler: GrammarCompiler, grammar: str, rng: random.Random) -> str:
    matcher = compiler.compile("grammar", grammar).matcher()
    out: list[int] = []
    for _ in range(300):
        allowed = np.flatnonzero(matcher.allowed().numpy()).tolist()
        others = [t for t in allowed if t not in EOS]
        if len(others) < len(allowed) and (not others or rng.random() < 0.5):
            break
        out.append(rng.choice(others))
        matcher.consume(out[-1])
        if matcher.finished:
            break
    else:
        raise AssertionError("the forced call never ended")
    return compiler.tokenizer.decode(out)


SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": {"type": "object"}}
SETUPS = {
    "hermes": (PLAIN_CHATML, "required", None),
    "hermes one": (HERMES_TEMPLATE, "required", False),
    "hermes named": (PLAIN_CHATML, {"type": "function", "function": {"name": "get_time"}}, None),
    "llama3": (LLAMA3_SNIPPET, "required", None),
    "mistral": (MISTRAL_SNIPPET, "required", None),
    "mistral one": (MISTRAL_SNIPPET, "required", False),
    "mistral named form": (MISTRAL_NAMED, "required", None),
}  # fmt: skip


@pytest.mark.parametrize("setup", list(SETUPS))
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_forced_calls_always_parse_and_validate(compiler, setup, seed):
    template, choice, parallel = SETUPS[setup]
    if isinstance(choice, dict):
        choice = NamedToolChoice.model_validate(choice)
    # SmolLM2 has no [TOOL_CALLS] token: Mistral's markers are spelled as text here
    tools = ToolRequest.create(TOOLS, choice, parallel, template)
    text = walk(compiler, tools.grammar(), random.Random(seed))
    content, calls = parse_tool_calls(tools.fmt, text)
    assert calls and content is None, text
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        if tools.forced:
            assert call.name == tools.forced
    if not tools.parallel or tools.forced or tools.fmt == LLAMA3:
        assert len(calls) == 1


# A tool whose parameters define and point at their own $defs ("#/$defs/city" from the
# parameters' root): forced calls gave a 400 "Pointer '/$defs/city' does not exist".
DEFS_TOOL = {
    "type": "function",
    "function": {
        "name": "plan_trip",
        "parameters": {
            "type": "object",
            "$defs": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "route": {
                    "type": "array",
                    "items": {"$ref": "#/$defs/city"},
                    "minItems": 1,
                    "maxItems": 2,
                },
            },
            "properties": {"start": {"$ref": "#/$defs/city"}, "via": {"$ref": "#/$defs/route"}},
            "required": ["start", "via"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("template", [PLAIN_CHATML, LLAMA3_SNIPPET, MISTRAL_SNIPPET, MISTRAL_NAMED])
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_forced_calls_with_parameter_defs_validate(compiler, template, seed):
    tools = ToolRequest.create(
        [Tool.model_validate(DEFS_TOOL), TOOLS[0]], "required", None, template
    )
    text = walk(compiler, tools.grammar(), random.Random(seed))
    content, calls = parse_tool_calls(tools.fmt, text)
    assert calls and content is None, text
    schemas = {"plan_trip": DEFS_TOOL["function"]["parameters"], **SCHEMAS}
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
