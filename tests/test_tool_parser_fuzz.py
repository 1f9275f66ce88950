"""The tool-call parser streamed against whole: one rule decides both, so a stream ends
with exactly the calls, content and finish reason of the whole answer, however the output
is cut into pieces. The cases the two once disagreed on, NaN and friends, fuzzed outputs
of markers, keys and JSON fragments, and the chat and /v1/messages routes over both."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jiter import from_json

from tokenmill.engine.llm_engine import RequestOutput
from tokenmill.sampling import FinishReason
from tokenmill.server.anthropic_routes import MessageFormat
from tokenmill.server.async_engine import Generation
from tokenmill.server.protocol import ChatFormat, Tool
from tokenmill.server.tool_parser import (
    MAX_JSON_DEPTH,
    Delta,
    ToolCallParser,
    arguments_object,
    parse_tool_calls,
)
from tokenmill.server.tools import ToolRequest
from tokenmill.tokenizer.chat import HERMES, LLAMA3, MISTRAL

Calls = list[tuple[str, str]]


def whole(fmt: str, text: str) -> tuple[str | None, Calls]:
    content, calls = parse_tool_calls(fmt, text)
    return content, [(c.name, c.arguments) for c in calls]


def streamed(fmt: str, text: str, cuts: list[int]) -> tuple[str | None, Calls]:
    """What a client makes of the stream: content joined, each call's id and name from
    its first entry and its arguments from all of its entries."""
    parser, total, start = ToolCallParser(fmt), Delta(), 0
    entries: list[dict] = []
    for cut in [*sorted(set(cuts)), len(text)]:
        delta = parser.feed(text[start:cut])
        entries += delta.tool_calls
        total.content += delta.content
        start = cut
    delta = parser.finish()
    entries += delta.tool_calls
    total.content += delta.content
    calls: dict[int, list[str]] = {}
    for entry in entries:
        if "id" in entry:  # a new call: the next index, never one seen before
            assert entry["index"] == len(calls) and entry["type"] == "function"
            assert entry["id"] == parser.calls[entry["index"]].id
            calls[entry["index"]] = [entry["function"]["name"], ""]
        calls[entry["index"]][1] += entry["function"]["arguments"]
    got = [(name, arguments) for name, arguments in calls.values()]
    assert got == [(c.name, c.arguments) for c in parser.calls]
    assert total.content == parser.content
    return total.content.strip() or None, got


def agree(fmt: str, text: str) -> tuple[str | None, Calls]:
    """The whole parse, once it is checked against the stream fed in one piece, a
    character at a time, and three at a time."""
    result = whole(fmt, text)
    for cuts in ([], list(range(len(text))), list(range(0, len(text), 3))):
        assert streamed(fmt, text, cuts) == result, (text, cuts)
    return result


# --------------------------------------------------------------------------- the cases

CALL = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'


@pytest.mark.parametrize(
    "text",
    [
        # a second "name": json.loads keeps the last, a stream had sent the first
        '<tool_call>{"name": "tool_call", "name": "f", "arguments": {}}</tool_call>',
        # arguments that are no object (nor a string holding one)
        '<tool_call>{"name": "f", "arguments": "oops"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        # cut off before the value of the arguments' first member began
        '<tool_call>{"name": "f", "arguments": ',
        '<tool_call>{"name": "f", "arguments": {"city": ',
        '<tool_call>{"name": "f", "arguments": {"n": 12',
        '<tool_call>{"name": "f"',
        "<tool_call>",
        # what JavaScript's JSON.parse refuses, though json.loads takes it
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": Infinity}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": -Infinity}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": -1' + "0" * 400 + "}}</tool_call>",
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": NaN}"}</tool_call>',
        '{"name": "f", "parameters": {"x": NaN}}',
        '[TOOL_CALLS]f[ARGS]{"x": 1e400}',
        '[TOOL_CALLS][{"name": "f", "arguments": {"x": NaN}}]',
    ],
)
def test_no_call_streamed_or_whole(text):
    fmt = MISTRAL if text.startswith("[") else LLAMA3 if text.startswith("{") else HERMES
    assert agree(fmt, text) == (text.strip(), [])


def test_a_valid_call_then_a_broken_one_keeps_the_first():
    """The first call went out before the second broke: whole, it is a call as well, and
    the second is content (all of it was content whole; streamed, both were calls)."""
    broken = '<tool_call>{"name": "g", "arguments": "oops"}</tool_call>'
    assert agree(HERMES, CALL + "\n" + broken) == (broken, [("f", '{"a": 1}')])
    content, calls = agree(MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": 1}]')
    assert (content, calls) == (', {"name": 1}]', [("f", "{}")])


def test_a_call_that_breaks_once_it_went_out_keeps_what_went_out():
    """Its first value going out sent the call; what was sent cannot be taken back, so
    whole, the call has the same arguments (the start of an object), and the text after
    them is content."""
    text = '<tool_call>{"name": "f", "arguments": {"a": 1, "x": NaN}}</tool_call> ok'
    assert agree(HERMES, text) == ("NaN}}</tool_call> ok", [("f", '{"a": 1, "x": ')])
    assert arguments_object('{"a": 1, "x": ') == {"a": 1}
    cut = '<tool_call>{"name": "f", "arguments": {"a": 1, "b": "Par'
    assert agree(HERMES, cut) == (None, [("f", '{"a": 1, "b": "Par')])
    assert arguments_object('{"a": 1, "b": "Par') == {"a": 1}
    # a number goes out once it has ended: 1e40 could still become 1e400
    number = '<tool_call>{"name": "f", "arguments": {"a": 1, "b": 1e40'
    assert agree(HERMES, number) == ("1e40", [("f", '{"a": 1, "b": ')])
    first = '<tool_call>{"name": "f", "arguments": {"city": "Par'
    assert agree(HERMES, first) == (None, [("f", '{"city": "Par')])
    assert arguments_object('{"city": "Par') == {}
    nested = '<tool_call>{"name": "f", "arguments": {"a": [NaN]}}'
    assert agree(HERMES, nested) == ("NaN]}}", [("f", '{"a": [')])
    done = '<tool_call>{"name": "f", "arguments": {"a": 1}, "name": "g"}</tool_call>'
    assert agree(HERMES, done) == (', "name": "g"}</tool_call>', [("f", '{"a": 1}')])
    twice = '<tool_call>{"name": "f", "arguments": {}, "parameters": {}}</tool_call>'
    assert agree(HERMES, twice) == (', "parameters": {}}</tool_call>', [("f", "{}")])


@pytest.mark.parametrize(
    "fmt, text, calls",
    [
        (HERMES, CALL, [("f", '{"a": 1}')]),
        (HERMES, '<tool_call>{"arguments": {"a": [1, {}]}, "name": "f"}', [("f", '{"a": [1, {}]}')]),
        (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', [("f", '{"a": 1}')]),
        (HERMES, '<tool_call>{"name": "f"}</tool_call>', [("f", "{}")]),
        (HERMES, '<tool_call>{"name": "f", "id": [1, "x"], "arguments": {"s": "\\u00e9\\n"}}', [("f", '{"s": "\\u00e9\\n"}')]),
        (HERMES, '<tool_call>{"name": "f", "arguments": {"x": 1.5e308, "y": -0.0}}', [("f", '{"x": 1.5e308, "y": -0.0}')]),
        (LLAMA3, '{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {}}', [("a", '{"n": 1}'), ("b", "{}")]),
        (MISTRAL, '[TOOL_CALLS]a[ARGS]{"q": "x"}[TOOL_CALLS]b[ARGS]{}', [("a", '{"q": "x"}'), ("b", "{}")]),
    ],
)  # fmt: skip
def test_calls_streamed_and_whole(fmt, text, calls):
    assert agree(fmt, text) == (None, calls)


def test_arguments_go_out_no_deeper_than_the_limit():
    """Nesting past MAX_JSON_DEPTH breaks the call where it passes the limit, within json's
    own stack (a call that deep could not come back in the history)."""
    deep = "[" * 400 + "]" * 400
    text = f'<tool_call>{{"name": "f", "arguments": {{"a": {deep}}}}}</tool_call>'
    sent = '{"a": ' + "[" * (MAX_JSON_DEPTH - 1)
    assert agree(HERMES, text) == (
        text[len('<tool_call>{"name": "f", "arguments": ') + len(sent) :],
        [("f", sent)],
    )
    assert agree(HERMES, text.replace(f'{{"a": {deep}}}', deep)) == (
        text.replace(f'{{"a": {deep}}}', deep),
        [],
    )


# --------------------------------------------------------------------------- the fuzz

PIECES = [
    # the markers every syntax knows, and their starts
    "<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[ARGS]", "[TOOL_",
    "<|python_tag|>", ";",
    # the call's keys
    '"name"', '"arguments"', '"parameters"', '"id"',
    # JSON fragments
    "{", "}", "[", "]", ":", ",", " ", "\n", '"', "\\", '"f"', '"tool_call"', '"oops"',
    '"{\\"a\\": 1}"', '"{\\"a\\": NaN}"', '"\\u00e9"', '"a\\', "1", "-2.5", "0", "01",
    "1e400", "1e40", "-", "NaN", "Infinity", "-Infinity", "true", "fals", "null",
    "Sure.", "x",
]  # fmt: skip
CALLS = [
    '{"name": "f", "arguments": {"a": 1, "b": [true, {"c": "x"}]}}',
    '{"name": "g", "parameters": {"q": "\\"}\\n", "n": -0.5e3}}',
    '{"arguments": {}, "name": "h"}',
    '{"name": "f", "arguments": "{\\"a\\": [1]}"}',
    '{"name": "f", "arguments": {"a": 1, "b": NaN}}',
    '{"name": "f", "name": "g", "arguments": {}}',
    'f[ARGS]{"a": "b"}',
]


OPENERS = ["<tool_call>", "<tool_call>\n", "[TOOL_CALLS]", "[TOOL_CALLS] [", "<|python_tag|>", ""]
CLOSERS = ["", "</tool_call>", "\n</tool_call>\n", "]", ", ", "; ", " ok"]


@st.composite
def calls(draw) -> str:
    """A call, framed by a syntax's markers (or another's): as written, with a fragment
    put in somewhere, or cut off."""
    call = draw(st.sampled_from(CALLS))
    if draw(st.booleans()):
        at = draw(st.integers(0, len(call)))
        call = call[:at] + draw(st.sampled_from(PIECES)) + call[at:]
    if draw(st.booleans()):
        call = call[: draw(st.integers(0, len(call)))]
    return draw(st.sampled_from(OPENERS)) + call + draw(st.sampled_from(CLOSERS))


@st.composite
def outputs(draw) -> str:
    """A model output: markers, keys, JSON fragments, text and calls, end to end."""
    return "".join(draw(st.lists(st.one_of(st.sampled_from(PIECES), calls()), max_size=12)))


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from([HERMES, LLAMA3, MISTRAL]), text=outputs(), data=st.data())
def test_streamed_equals_whole_on_fuzzed_outputs(fmt, text, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    result = whole(fmt, text)
    assert streamed(fmt, text, cuts) == result, cuts
    assert streamed(fmt, text, list(range(len(text)))) == result
    content, calls = result
    assert calls or content == (text.strip() or None)  # no call: the text as written
    for _, arguments in calls:
        # complete arguments are an object JSON.parse reads; the others (the call broke)
        # are the start of one
        try:
            value = json.loads(arguments, parse_constant=_refuse)
        except json.JSONDecodeError:
            assert isinstance(arguments_object(arguments), dict)
        else:
            assert isinstance(value, dict) and _finite(value)
            assert arguments_object(arguments) == value


def _refuse(constant: str) -> None:
    raise AssertionError(f"{constant} went out in a call's arguments")


def _finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


# --------------------------------------------------------------------------- the routes

TOOLS = [Tool.model_validate({"type": "function", "function": {"name": n}}) for n in "fg"]
ROUTE_CASES = [
    CALL,
    '<tool_call>{"name": "f", "arguments": ',
    '<tool_call>{"name": "f", "arguments": "oops"}</tool_call>',
    CALL + '<tool_call>{"name": "g", "arguments": "oops"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1, "x": NaN}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1, "b": "Par',
]


def _outputs(text: str, reason: FinishReason) -> list[RequestOutput]:
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)] or [""]
    return [
        RequestOutput(
            "r", piece, [1], [], i == len(pieces) - 1, reason if i == len(pieces) - 1 else None,
            1, i + 1, 0, 0.0, None, None,
        )
        for i, piece in enumerate(pieces)
    ]  # fmt: skip


@pytest.mark.parametrize("reason", [FinishReason.STOP, FinishReason.LENGTH])
@pytest.mark.parametrize("text", ROUTE_CASES)
def test_chat_completions_stream_as_whole(text, reason):
    tools = ToolRequest.create(TOOLS, "auto", None, None)
    chat = ChatFormat("r", "m", str, False, tools=tools)
    choice = chat._choice(0, Generation(text=text, token_ids=[1], finish_reason=reason))
    content, calls, finish = "", {}, None
    for out in _outputs(text, reason):
        chunk = chat.chunk(0, out)
        if chunk is None:
            continue
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"name": None, "arguments": ""})
            call["name"] = call["name"] or entry["function"].get("name")
            call["arguments"] += entry["function"]["arguments"]
        finish = chunk["choices"][0]["finish_reason"] or finish
    message = choice["message"]
    assert (content.strip() or None) == message["content"]
    assert list(calls.values()) == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls", [])
    ]
    assert finish == choice["finish_reason"]


@pytest.mark.parametrize("reason", [FinishReason.STOP, FinishReason.LENGTH])
@pytest.mark.parametrize("text", ROUTE_CASES)
def test_messages_stream_as_whole(text, reason):
    """/v1/messages: the input the anthropic SDK builds from the stream's partial_json
    (jiter, as the SDK reads it) is the whole message's input."""
    tools = ToolRequest.create(TOOLS, "auto", None, None)
    whole_message = MessageFormat("msg", "m", 1, tools).message(
        Generation(text=text, token_ids=[1], finish_reason=reason), None
    )
    messages = MessageFormat("msg", "m", 1, tools)
    blocks: dict[int, dict] = {}
    stop = None
    for out in _outputs(text, reason):
        for event in messages.feed(out):
            if event["type"] == "content_block_start":
                blocks[event["index"]] = {**event["content_block"], "json": ""}
            elif event["type"] == "content_block_delta":
                block, delta = blocks[event["index"]], event["delta"]
                if delta["type"] == "text_delta":
                    block["text"] += delta["text"]
                else:
                    block["json"] += delta["partial_json"]
                    block["input"] = from_json(block["json"].encode(), partial_mode=True)
            elif event["type"] == "message_delta":
                stop = event["delta"]["stop_reason"]
    text_blocks = "".join(b["text"] for b in blocks.values() if b["type"] == "text")
    uses = [(b["name"], b["input"]) for b in blocks.values() if b["type"] == "tool_use"]
    content = whole_message["content"]
    assert (text_blocks.strip() or None) == next(
        (b["text"] for b in content if b["type"] == "text"), None
    )
    assert uses == [(b["name"], b["input"]) for b in content if b["type"] == "tool_use"]
    assert stop == whole_message["stop_reason"]
