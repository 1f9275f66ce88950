"""Reasoning output: tokenizer/reasoning.py's streaming split of
`<think>...</think>`, the engine applying stop strings and the constraint to the answer
after it, and the chat route's reasoning_content, chat_template_kwargs and
reasoning_effort, through the openai client against a served random-weight Qwen3 whose
template opens `<think>` in the prompt; and gpt-oss's harmony channels, split by the same
parser interface and served from a tiny GPT-2 whose weights write a harmony answer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tokenmill.server.cli import REASONING_PARSERS
from tokenmill.tokenizer.reasoning import (
    PARSER_CHOICES,
    THINK,
    HarmonyParser,
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
        start_parser("glm")


def test_the_template_picks_the_parser():
    qwen3 = "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    assert detect(qwen3) == "think" and detect("{{ messages }}") is None and detect(None) is None
    assert resolve("auto", qwen3) == "think" and resolve("none", qwen3) is None
    assert resolve("think", None) == "think"
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        resolve("glm", qwen3)
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


def build_thinking_model(folder: Path, template: str = TEMPLATE) -> None:
    """A tiny random Qwen3 whose words are t0..t316, <think>, </think> and EOS, with
    `template` as its chat template."""
    from helpers import build_hf_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    build_hf_model("qwen3", folder)
    vocab = {f"t{i}": i for i in range(THINK_ID)}
    vocab.update({"<think>": THINK_ID, "</think>": END_ID, f"t{EOS}": EOS})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": f"t{EOS}", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def serve_tiny(folder: Path):
    """`tokenmill serve` of a model built here, as "tiny", on one thread (a context)."""
    from server_fixture import running_server

    args = ("--model", str(folder), "--served-model-name", "tiny", "--kv-cache-memory", "512tok")
    return running_server(*args, "--threads", "1")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("thinking")
    build_thinking_model(folder)
    with serve_tiny(folder) as url:
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


# --------------------------------------------------------------------------- harmony

GENERATION_PROMPT = "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant"
WEATHER_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
# (answer, the prompt's tail, (reasoning, content)): what gpt-oss writes after its
# generation prompt, and the edges: cut off in the analysis, in a header, in a marker.
HARMONY_TEXTS = [
    (
        "<|channel|>analysis<|message|>2+2 is 4, <b>simple</b>.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>The answer is **4**.<|return|>",
        GENERATION_PROMPT,
        ("2+2 is 4, <b>simple</b>.", "The answer is **4**."),
    ),
    (  # analysis only (cut off): everything is reasoning, a partial marker too
        "<|channel|>analysis<|message|>Still thinking when the tokens ran out <|en",
        GENERATION_PROMPT,
        ("Still thinking when the tokens ran out <|en", ""),
    ),
    (  # final only, with a constraint's header
        '<|channel|>final <|constrain|>json<|message|>{"a": 1}<|return|>',
        GENERATION_PROMPT,
        ("", '{"a": 1}'),
    ),
    (  # a tool call, addressed after the channel (gpt-oss's usual place), then its end
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>',
        GENERATION_PROMPT,
        ("Need the weather.", WEATHER_CALL),
    ),
    (  # addressed in the role header, a preamble before it, and its <|call|> not shown
        # (a stop token's text never reaches the parser)
        "<|channel|>commentary<|message|>Let me look.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
        '<|message|>{"city": "Paris"}',
        GENERATION_PROMPT,
        ("", "Let me look." + WEATHER_CALL),
    ),
    (  # a call without arguments; the model writes <|start|>assistant itself
        "<|start|>assistant<|channel|>commentary to=functions.now<|message|><|call|>",
        "<|end|>",
        ("", '<tool_call>{"name": "now", "arguments": {}}</tool_call>'),
    ),
    (  # the template opened the analysis; two analysis messages joined as written
        "first, <|end|><|start|>assistant<|channel|>analysis<|message|>second"
        "<|end|><|channel|>final<|message|>done <|",
        "<|start|>assistant<|channel|>analysis<|message|>",
        ("first, second", "done <|"),
    ),
    ("<|channel|>analy", GENERATION_PROMPT, ("", "")),  # cut off in the header
    ("  no harmony at all <|\n", "", ("", "no harmony at all <|")),  # stripped, outside
    ("", GENERATION_PROMPT, ("", "")),
]


def feed_harmony(parser: HarmonyParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


def chunked(text: str):
    """The text in deltas of every size from 1 to its length."""
    for size in range(1, len(text) + 1):
        yield [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("text, tail, expected", HARMONY_TEXTS)
def test_harmony_splits_the_same_however_it_streams(text, tail, expected):
    assert split(text, "harmony", tail) == expected
    for pieces in [*chunked(text), *splits(text)]:
        assert feed_harmony(HarmonyParser(tail), pieces) == expected, pieces


def test_harmony_streams_no_marker_and_releases_text_early():
    text, tail, _ = HARMONY_TEXTS[0]
    parser = HarmonyParser(tail)
    shown = []
    for char in text:
        shown.append(parser.feed(char))
        assert "<|" not in "".join(shown[-1]), shown[-1]  # never a marker, not even part
    assert parser.finish() == ("", "")
    # a body's text goes out as it comes; only a possible marker waits
    assert parser.feed("") == ("", "")
    later = HarmonyParser(GENERATION_PROMPT)
    assert later.feed("<|channel|>analysis<|message|>ab<") == ("ab", "")
    assert later.feed("b") == ("<b", "")


def test_harmony_says_where_the_answer_starts():
    # the generation prompt leaves the answer in a header: the constraint waits
    parser = start_parser("harmony", GENERATION_PROMPT)
    assert isinstance(parser, HarmonyParser) and parser.reasoned and not parser.ended
    assert parser.feed("<|channel|>analysis<|message|>hmm<|end|>") == ("hmm", "")
    assert not parser.ended
    assert parser.feed("<|start|>assistant<|channel|>final<|message|>") == ("", "")
    assert parser.ended  # the final channel started: a constraint applies from here
    # an answer starting in its final message is constrained from its first token
    final = start_parser("harmony", "<|start|>assistant<|channel|>final<|message|>")
    assert final.ended and not final.reasoned
    # a preamble is content, but not yet the answer
    preamble = start_parser("harmony", GENERATION_PROMPT)
    assert preamble.feed("<|channel|>commentary<|message|>One moment.") == ("", "One moment.")
    assert not preamble.ended
    # the prompt's own earlier final message is not this answer's
    assert not start_parser("harmony", "<|channel|>final<|message|>hi<|end|>").ended


def test_harmony_calls_read_as_the_template_s_tool_calls():
    from tokenmill.server.tool_parser import parse_tool_calls
    from tokenmill.tokenizer.chat import HERMES, tool_format

    # the call syntax a harmony template gets is Hermes', which the rewrite speaks
    assert tool_format(HARMONY_TEMPLATE) == HERMES
    text, tail, (_, content) = HARMONY_TEXTS[3]
    assert parse_tool_calls(HERMES, content)[0] is None
    (call,) = parse_tool_calls(HERMES, content)[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    # arguments that are not JSON leave the call as text, as for any template
    broken = split("<|channel|>commentary to=functions.f<|message|>oops", "harmony", tail)[1]
    assert parse_tool_calls(HERMES, broken) == (broken, [])


def test_the_template_picks_harmony():
    assert detect(HARMONY_TEMPLATE) == "harmony" and resolve("auto", HARMONY_TEMPLATE) == "harmony"
    assert resolve("harmony", None) == "harmony" and "harmony" in PARSER_CHOICES


# --------------------------------------------------------------------------- harmony, served

# A harmony-style template, small: gpt-oss's turns and generation prompt, the tools' names
# in a developer message (so the template renders tools), an earlier answer's final channel.
HARMONY_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|>"
    "{% for t in tools %}{{ t.function.name }} {% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}<|start|>{{ m.role }}"
    "{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
HARMONY_SPECIALS = (
    "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"
)  # fmt: skip
HARMONY_IDS = {s: VOCAB - len(HARMONY_SPECIALS) + i for i, s in enumerate(HARMONY_SPECIALS)}
HARMONY_WORDS = ("assistant", "user", "developer", "analysis", "final", "commentary")
HARMONY_WORDS += ("to=functions.get_weather", "json", '{"city":', '"Paris"}', "get_weather")
HARMONY_IDS.update({w: 290 + i for i, w in enumerate(HARMONY_WORDS)})
# What the model writes (words, as its tokenizer joins them with spaces): for HELLO an
# analysis and a final answer; for WEATHER (41 prompt tokens) an analysis and a call.
ANSWER = (
    "<|channel|> analysis <|message|> t7 t8 t9 <|end|> <|start|> assistant"
    " <|channel|> final <|message|> t10 t11 <|return|>"
)
CALLING = (
    "<|channel|> analysis <|message|> t7 <|end|> <|start|> assistant to=functions.get_weather"
    ' <|channel|> commentary <|constrain|> json <|message|> {"city": "Paris"} <|call|>'
)
WEATHER = [{"role": "user", "content": " ".join(f"t{i}" for i in range(10, 40))}]
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
HELLO_PROMPT_TOKENS, WEATHER_PROMPT_TOKENS = 8, 41


def build_harmony_model(folder: Path) -> None:
    """A tiny GPT-2 whose tokenizer has harmony's special tokens and whose greedy answer
    is ANSWER after HELLO's prompt and CALLING after WEATHER's with its tool.

    Its blocks add nothing (their output projections are zero), so the last norm sees the
    token's embedding plus its position's: a one-hot embedding per word the answers use
    and, at each position an answer's token is predicted from, ten times the next word's
    one-hot, which the tied output projection then picks."""
    import torch
    from helpers import build_hf_model
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model = build_hf_model("gpt2", folder)
    plans = [(HELLO_PROMPT_TOKENS, ANSWER), (WEATHER_PROMPT_TOKENS, CALLING)]
    answers = [[HARMONY_IDS.get(w) or int(w[1:]) for w in text.split()] for _, text in plans]
    dim = {token: i for i, token in enumerate(sorted({t for ids in answers for t in ids}))}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".c_proj." in name:  # attention's and the MLP's output projections
                p.zero_()
        model.transformer.ln_f.weight.fill_(1.0)
        model.transformer.ln_f.bias.zero_()
        wte, wpe = model.transformer.wte.weight, model.transformer.wpe.weight
        wte.zero_()
        wpe.zero_()
        for token, i in dim.items():
            wte[token, i] = 1.0
        for (prompt_tokens, _), ids in zip(plans, answers, strict=True):
            for k, token in enumerate(ids):  # position prompt_tokens - 1 + k writes ids[k]
                wpe[prompt_tokens - 1 + k, dim[token]] = 10.0
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    for word, i in HARMONY_IDS.items():
        del vocab[f"t{i}"]
        vocab[word] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    tok.add_special_tokens([AddedToken(s, special=True) for s in HARMONY_SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|return|>", "chat_template": HARMONY_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    # gpt-oss's turn ends at <|return|> or <|call|>; <|end|> only ends a message
    stops = [HARMONY_IDS["<|return|>"], HARMONY_IDS["<|call|>"]]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))


@pytest.fixture(scope="module")
def harmony_client(tmp_path_factory):
    from openai import OpenAI
    from server_fixture import running_server

    folder = tmp_path_factory.mktemp("harmony")
    build_harmony_model(folder)
    args = ("--model", str(folder), "--served-model-name", "tiny", "--kv-cache-memory", "512tok")
    with running_server(*args, "--threads", "1") as url:  # the reasoning parser: auto
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


GREEDY = dict(temperature=0.0, max_tokens=40)


def streamed(client, **kwargs) -> list[tuple[str, str]]:
    """A streamed chat answer as (kind, text) parts: reasoning, content or call."""
    parts: list[tuple[str, str]] = []
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kwargs):
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning_content", None):
            parts.append(("reasoning", delta.reasoning_content))
        if delta.content:
            parts.append(("content", delta.content))
        for call in delta.tool_calls or []:
            parts.append(("call", (call.function.name or "") + (call.function.arguments or "")))
    return parts


def joined(parts: list[tuple[str, str]], kind: str) -> str:
    return "".join(text for k, text in parts if k == kind)


def test_harmony_reasoning_and_content_apart(harmony_client):
    raw = harmony_client.completions.create(
        model="tiny", prompt="<|start|>user<|message|>t5 t6<|end|><|start|>assistant", **GREEDY
    )
    # the premise; and <|end|> (an end-of-turn piece for Phi-3) does not stop a harmony
    # vocabulary's answer after its analysis
    assert raw.choices[0].text == " " + ANSWER.removesuffix(" <|return|>")
    whole = harmony_client.chat.completions.create(model="tiny", messages=HELLO, **GREEDY)
    message = whole.choices[0].message
    # the bodies as the test tokenizer writes them, spaces around its words
    assert (message.reasoning_content, message.content) == (" t7 t8 t9 ", " t10 t11")
    assert whole.usage.prompt_tokens == HELLO_PROMPT_TOKENS
    assert whole.usage.completion_tokens == len(ANSWER.split())
    parts = streamed(harmony_client, messages=HELLO, **GREEDY)
    assert [k for k, _ in parts] == sorted((k for k, _ in parts), key=lambda k: k == "content")
    assert (joined(parts, "reasoning"), joined(parts, "content")) == (" t7 t8 t9 ", " t10 t11")


def test_harmony_call_is_a_tool_call(harmony_client):
    asked = dict(messages=WEATHER, tools=[WEATHER_TOOL], **GREEDY)
    whole = harmony_client.chat.completions.create(model="tiny", **asked)
    choice = whole.choices[0]
    assert whole.usage.prompt_tokens == WEATHER_PROMPT_TOKENS
    assert (choice.message.reasoning_content, choice.message.content) == (" t7 ", None)
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.finish_reason == "tool_calls"
    parts = streamed(harmony_client, **asked)
    assert joined(parts, "reasoning") == " t7 " and joined(parts, "content") == ""
    assert json.loads(joined(parts, "call").removeprefix("get_weather")) == {"city": "Paris"}


def test_harmony_constraint_starts_at_the_final_channel(harmony_client):
    whole = harmony_client.chat.completions.create(
        model="tiny", messages=HELLO, extra_body={"guided_regex": " ?t9 t9"}, **GREEDY
    )
    message = whole.choices[0].message
    assert message.reasoning_content == " t7 t8 t9 "  # unconstrained through the headers
    assert message.content.strip() == "t9 t9"
    assert whole.choices[0].finish_reason == "stop"
