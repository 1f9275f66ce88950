"""Reasoning output (issue 25 item 1): tokenizer/reasoning.py's streaming split of
`<think>...</think>`, the engine applying stop strings and the constraint to the answer
after it, and the chat route's reasoning_content, chat_template_kwargs and
reasoning_effort, through the openai client against a served random-weight Qwen3 whose
template opens `<think>` in the prompt."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tokenmill.server.cli import REASONING_PARSERS
from tokenmill.tokenizer.reasoning import (
    PARSER_CHOICES,
    THINK,
    ReasoningParser,
    detect,
    resolve,
    split,
    start_parser,
)

# --------------------------------------------------------------------------- the parser


def oracle(text: str, inside: bool) -> tuple[str, str]:
    """The split the parser's docstring promises, at once, by regular expression."""
    if not inside:
        opened = re.match(r"\s*<think>", text)
        if opened is None:
            return "", text
        text = text[opened.end() :]
    body, closed, rest = text.partition("</think>")
    return (body.strip(), rest.lstrip()) if closed else (body.strip(), "")


# What reasoning models write (Qwen3's and DeepSeek-R1's shapes), and the edges: no closing
# tag, text before the tag, tags cut short at the end, a second tag inside.
TEXTS = [
    "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\nThe answer is **4**.",
    "\n<think>\nHmm, <think> is text in here.\n\n</think>\n\n2 + 2 = 4.\n\nDone </think>",
    "<think>\nStill thinking when the tokens ran out, about < and </",
    "Sure: 4. <think>this is not reasoning</think> said so",
    "  no tag at all, just an answer\n",
    "<thinking>is not the tag</thinking>",
    "<think></think>Empty reasoning, an answer",
    "<think>\n\n</think>",
    "ends on a partial tag <thi",
    "<thi",
    "",
]
INSIDE_TEXTS = [
    "Okay, the prompt opened the tag.\n</think>\n\nSo the answer: yes.",
    "\nno closing tag ever comes ...\n</thin",
    "</think>only an answer",
    "   \n  ",
]


def feed_pieces(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for piece in pieces:
        r, c = parser.feed(piece)
        assert not (c and not parser.ended), "content before the reasoning ended"
        assert not (r and content), "reasoning after content"
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


def splits(text: str):
    """The text whole, char by char, and cut at every one and every two places."""
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i in range(0, len(text) + 1, 3):
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize(
    "text, inside", [(t, False) for t in TEXTS] + [(t, True) for t in INSIDE_TEXTS]
)
def test_every_split_gives_the_same_parts(text, inside):
    expected = oracle(text, inside)
    for pieces in splits(text):
        assert feed_pieces(ReasoningParser(THINK, inside=inside), pieces) == expected, pieces


def test_what_the_cases_split_into():
    assert oracle(TEXTS[0], False) == (
        "The user asks for 2+2. That is 4.",
        "The answer is **4**.",
    )
    assert oracle(TEXTS[3], False) == ("", TEXTS[3])  # text before <think>: all answer
    assert oracle(TEXTS[2], False)[1] == ""  # no closing tag: all reasoning


def test_the_prompt_says_where_the_answer_starts():
    # DeepSeek-R1's template opens the tag; Qwen3's with enable_thinking false closes it
    assert start_parser("think", "<｜Assistant｜><think>\n").ended is False
    assert start_parser("think", "<|im_start|>assistant\n<think>\n\n</think>\n\n") is None
    before = start_parser("think", "<|im_start|>assistant\n")
    assert before is not None and not before.reasoned
    assert split("<think>a</think> b", "think") == ("a", "b")
    assert split("a</think> b", "think", "x <think>") == ("a", "b")
    with pytest.raises(ValueError, match="unknown reasoning format"):
        start_parser("harmony")


def test_the_template_picks_the_parser():
    qwen3 = "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    assert detect(qwen3) == "think" and detect("{{ messages }}") is None and detect(None) is None
    assert resolve("auto", qwen3) == "think" and resolve("none", qwen3) is None
    assert resolve("think", None) == "think"
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        resolve("harmony", qwen3)
    assert REASONING_PARSERS == PARSER_CHOICES  # the CLI's copy of the choices


# --------------------------------------------------------------------------- served

VOCAB = 320
THINK_ID, END_ID, EOS = VOCAB - 3, VOCAB - 2, VOCAB - 1
# Qwen3's shape, small: the prompt opens <think> unless enable_thinking is false (then an
# empty block closes it), and reasoning_effort is written where the template reads it.
TEMPLATE = (
    "{% for m in messages %}{{ m.content }} {% endfor %}"
    "{% if reasoning_effort is defined %}effort {{ reasoning_effort }} {% endif %}"
    "{% if add_generation_prompt %}<think> "
    "{% if enable_thinking is defined and enable_thinking is false %}</think> {% endif %}"
    "{% endif %}"
)


def build_thinking_model(folder: Path) -> None:
    """A tiny random Qwen3 whose words are t0..t316, <think>, </think> and EOS."""
    from helpers import build_hf_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    build_hf_model("qwen3", folder)
    vocab = {f"t{i}": i for i in range(THINK_ID)}
    vocab.update({"<think>": THINK_ID, "</think>": END_ID, f"t{EOS}": EOS})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": f"t{EOS}", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from server_fixture import running_server

    folder = tmp_path_factory.mktemp("thinking")
    build_thinking_model(folder)
    args = ("--model", str(folder), "--served-model-name", "tiny", "--kv-cache-memory", "512tok")
    args += ("--threads", "1")
    with running_server(*args) as url:
        yield url


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)


HELLO = [{"role": "user", "content": "t5 t6"}]
# Sampled (seeded), with </think> made likely and EOS unlikely, so that the reasoning ends
# part way through (here after 10 words) and an answer of 30 words follows.
SAMPLED = dict(
    temperature=1.0, seed=5, max_tokens=40, logit_bias={str(END_ID): 5.0, str(EOS): -100.0}
)


def raw_text(client, prompt: str, **kwargs) -> str:
    """The same generation without the split: /v1/completions on the rendered prompt."""
    out = client.completions.create(model="tiny", prompt=prompt, **{**SAMPLED, **kwargs})
    return out.choices[0].text


def test_reasoning_and_content_apart(client):
    raw = raw_text(client, "t5 t6 <think>")
    assert "</think>" in raw, "the reasoning should end for this test to mean something"
    whole = client.chat.completions.create(model="tiny", messages=HELLO, **SAMPLED)
    message = whole.choices[0].message
    reasoning, content = oracle(raw, inside=True)
    assert reasoning and content
    assert (message.reasoning_content, message.content) == (reasoning, content)
    # every token counts, the reasoning's too
    assert whole.usage.completion_tokens == len(raw.split())

    stream = client.chat.completions.create(model="tiny", messages=HELLO, stream=True, **SAMPLED)
    parts: list[tuple[str, str]] = []
    for chunk in stream:
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning_content", None):
            parts.append(("reasoning", delta.reasoning_content))
        if delta.content:
            parts.append(("content", delta.content))
    kinds = [kind for kind, _ in parts]
    assert kinds == sorted(kinds, key=lambda kind: kind == "content")  # reasoning first
    assert "".join(t for k, t in parts if k == "reasoning") == reasoning
    assert "".join(t for k, t in parts if k == "content") == content


def test_enable_thinking_false_reaches_the_template(client):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    whole = client.chat.completions.create(model="tiny", messages=HELLO, extra_body=off, **SAMPLED)
    message = whole.choices[0].message
    # the prompt closed the reasoning: the whole answer is content, as generated
    assert message.reasoning_content is None
    assert message.content == raw_text(client, "t5 t6 <think> </think>")
    assert whole.usage.prompt_tokens == 4


def test_reasoning_effort_reaches_the_template(client):
    low = client.chat.completions.create(
        model="tiny", messages=HELLO, reasoning_effort="low", max_tokens=1
    )
    plain = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1)
    assert low.usage.prompt_tokens == plain.usage.prompt_tokens + 2  # "effort low"


def test_stop_strings_apply_to_the_answer(client):
    raw = raw_text(client, "t5 t6 <think>")
    reasoning, content = oracle(raw, inside=True)
    # a word of the reasoning, and the closing tag, which the answer repeats here
    stop = [reasoning.split()[0], "</think>"]
    assert "</think>" in content
    whole = client.chat.completions.create(model="tiny", messages=HELLO, stop=stop, **SAMPLED)
    message = whole.choices[0].message
    assert message.reasoning_content == reasoning  # neither stopped the reasoning
    assert message.content == content[: min(content.find(s) for s in stop if s in content)]
    assert whole.choices[0].finish_reason == "stop"


def test_the_constraint_starts_after_the_reasoning(client):
    raw = raw_text(client, "t5 t6 <think>")
    reasoning, _ = oracle(raw, inside=True)
    whole = client.chat.completions.create(
        model="tiny", messages=HELLO, extra_body={"guided_regex": "t9 t9"}, **SAMPLED
    )
    message = whole.choices[0].message
    assert message.reasoning_content == reasoning  # unconstrained while it reasons
    assert message.content == "t9 t9"
    assert whole.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"chat_template_kwargs": {"messages": []}}, "cannot set 'messages'"),
        ({"chat_template_kwargs": {"raise_exception": 1}}, "cannot set 'raise_exception'"),
        ({"chat_template_kwargs": {"not a name": 1}}, "not a name"),
        ({"chat_template_kwargs": {"x": json.loads("[" * 301 + "]" * 301)}}, "nests"),
        ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ],
)
def test_bad_template_variables_are_400s(served, kwargs, message):
    import httpx

    body = {"messages": HELLO, "max_tokens": 1, **kwargs}
    answer = httpx.post(f"{served}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert message in error["message"]
    assert error["param"] is None or error["param"].startswith(next(iter(kwargs)))


# --------------------------------------------------------------------------- LLM.chat, CLI


def test_llm_chat_returns_the_reasoning_apart(tmp_path):
    from tokenmill import LLM, SamplingParams

    build_thinking_model(tmp_path)
    params = {k: v for k, v in SAMPLED.items() if k != "logit_bias"}
    params = SamplingParams(**params, logit_bias={END_ID: 5.0, EOS: -100.0})
    with LLM(tmp_path, kv_cache_memory="512tok", threads=1) as llm:
        raw = llm.generate("t5 t6 <think>", params)[0]
        out = llm.chat(HELLO, params)
        whole = llm.chat(HELLO, params, reasoning_parser=None)
    assert raw.reasoning is None and whole.text == raw.text  # not split unless asked
    assert (out.reasoning, out.text) == oracle(raw.text, inside=True)
    assert out.token_ids == raw.token_ids


def test_the_chat_command_folds_the_thinking():
    from tokenmill.cli.chat import Conversation

    chat = Conversation()
    assert chat.command("/think") == "no thinking in the last answer"
    chat.last_thinking = "hmm"
    assert chat.command("/think off") == "thinking folded" and not chat.show_thinking
    assert chat.command("/think") == "hmm"
    assert chat.command("/think on") == "thinking shown" and chat.show_thinking
    assert chat.command("/think maybe").startswith("usage")
