"""Reasoning in POST /v1/responses, through the real `openai` SDK.

A random-weight Qwen3 (tests/test_reasoning.py's build_thinking_model: words t0..t316,
<think>, </think>, EOS) served on 127.0.0.1, with a Qwen3-shaped template that opens
`<think>` in the prompt. The Responses API has no logit_bias and no seed, so its weights
force the answer instead: every block's output projections are zero, so the last norm
sees the last token's embedding alone, a one-hot for each word of ANSWER, and the output
projection maps each to the next word. Greedy, the model writes
`t10 t11 t12 </think> t20 t21` then EOS after the prompt's `<think>`: a reasoning item
"t10 t11 t12", then a message "t20 t21", whole and streamed (the events typed by the SDK,
the stream helper's final response), cut short by max_output_tokens, switched off by
reasoning.effort "none", and sent back as input (the template reads reasoning_content).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import pytest
from test_reasoning import END_ID, EOS, THINK_ID, build_thinking_model, serve_tiny

openai = pytest.importorskip("openai")
from openai.types.responses import (  # noqa: E402
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseOutputItemAddedEvent,
    ResponseReasoningItem,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseTextDeltaEvent,
)

ANSWER = [THINK_ID, 10, 11, 12, END_ID, 20, 21, EOS]  # each token writes the next
REASONING, CONTENT = "t10 t11 t12", "t20 t21"
# Qwen3's shape, small: earlier assistant turns' reasoning_content inside <think> tags,
# reasoning_effort where the template reads it, and the generation prompt opening <think>
# (closing it again when enable_thinking is false). Every word outside t0..t316 and the
# tags is the unknown word t0, one token.
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.reasoning_content %}<think> {{ m.reasoning_content }} </think> {% endif %}"
    "{{ m.content }} {% endfor %}"
    "{% if reasoning_effort is defined %}effort {{ reasoning_effort }} {% endif %}"
    "{% if add_generation_prompt %}<think> "
    "{% if enable_thinking is defined and enable_thinking is false %}</think> {% endif %}"
    "{% endif %}"
)
GREEDY = dict(model="tiny", temperature=0, max_output_tokens=20)


def build_answering_model(folder: Path) -> None:
    """build_thinking_model's random Qwen3, its weights made to write ANSWER (see the
    module docstring); TEMPLATE as its chat template."""
    import torch
    from transformers import AutoModelForCausalLM

    build_thinking_model(folder, TEMPLATE)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert not model.config.tie_word_embeddings  # the output projection is its own
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        model.model.norm.weight.fill_(1.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for dim, (token, following) in enumerate(itertools.pairwise(ANSWER)):
            embed[token] = 0.0
            embed[token, dim] = 1.0
            head[following, dim] = 10.0
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("answering")
    build_answering_model(folder)
    with serve_tiny(folder) as url:  # the reasoning parser: auto
        yield url


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0)


def items(output) -> list[dict]:
    """Output items as dicts, their ids left out (each response makes its own)."""
    return [
        {k: v for k, v in item.model_dump(exclude_none=True).items() if k != "id"}
        for item in output
    ]


def test_the_weights_write_the_answer(client):
    """The premise, unsplit: /v1/completions on the rendered prompt."""
    raw = client.completions.create(model="tiny", prompt="t5 t6 <think>", max_tokens=20)
    assert raw.choices[0].text == f" {REASONING} </think> {CONTENT}"
    assert raw.choices[0].finish_reason == "stop"


def test_the_thinking_is_a_reasoning_item_before_the_message(client):
    response = client.responses.create(input="t5 t6", **GREEDY)
    assert response.status == "completed"
    reasoning, message = response.output
    assert isinstance(reasoning, ResponseReasoningItem)
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", REASONING)]
    assert reasoning.status == "completed"
    assert message.type == "message" and response.output_text == CONTENT
    usage = response.usage
    assert usage.input_tokens == 3  # t5 t6 <think>
    assert usage.output_tokens == len(ANSWER) - 1  # EOS included, as the chat route counts
    # t10 t11 t12 and the closing tag: the tokens before the answer's first text
    assert usage.output_tokens_details.reasoning_tokens == 4
    # the chat route splits the same answer the same way
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "t5 t6"}], temperature=0
    )
    assert chat.choices[0].message.reasoning_content == REASONING
    assert chat.choices[0].message.content == CONTENT
    assert chat.usage.completion_tokens == usage.output_tokens


def test_streamed_the_reasoning_events_come_first(client):
    whole = client.responses.create(input="t5 t6", **GREEDY)
    events = list(client.responses.create(input="t5 t6", stream=True, **GREEDY))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if isinstance(e, ResponseReasoningTextDeltaEvent)]
    text_deltas = [e for e in events if isinstance(e, ResponseTextDeltaEvent)]
    assert deltas and text_deltas
    names = [e.type for e in events]
    reasoning_events = [
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * len(deltas),
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    message_events = [
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(text_deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert names == [
        "response.created",
        "response.in_progress",
        *reasoning_events,
        *message_events,
        "response.completed",
    ]
    added = [e for e in events if isinstance(e, ResponseOutputItemAddedEvent)]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "reasoning"), (1, "message")]
    part = next(e for e in events if isinstance(e, ResponseContentPartAddedEvent))
    assert part.part.type == "reasoning_text" and part.item_id == added[0].item.id
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {
        (added[0].item.id, 0, 0)
    }
    assert "".join(e.delta for e in deltas) == REASONING
    [done] = [e for e in events if isinstance(e, ResponseReasoningTextDoneEvent)]
    assert done.text == REASONING
    assert "".join(e.delta for e in text_deltas) == CONTENT
    completed = events[-1]
    assert isinstance(completed, ResponseCompletedEvent)
    assert items(completed.response.output) == items(whole.output)
    assert completed.response.usage == whole.usage
    # the SDK's stream helper accumulates the same response
    with client.responses.stream(input="t5 t6", **GREEDY) as stream:
        final = stream.get_final_response()
    assert items(final.output) == items(whole.output)
    assert final.usage.output_tokens_details.reasoning_tokens == 4


def test_max_output_tokens_cuts_the_reasoning(client):
    short = {**GREEDY, "max_output_tokens": 2}
    whole = client.responses.create(input="t5 t6", **short)
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    reasoning, message = whole.output  # the (empty) message is there all the same
    assert (reasoning.content[0].text, reasoning.status) == ("t10 t11", "incomplete")
    assert (message.content[0].text, message.status) == ("", "incomplete")
    assert whole.usage.output_tokens_details.reasoning_tokens == 2
    events = list(client.responses.create(input="t5 t6", stream=True, **short))
    assert events[-1].type == "response.incomplete"
    assert items(events[-1].response.output) == items(whole.output)


def test_reasoning_effort_reaches_the_template(client):
    plain = client.responses.create(input="t5 t6", **GREEDY)
    low = client.responses.create(input="t5 t6", reasoning={"effort": "low"}, **GREEDY)
    assert low.usage.input_tokens == plain.usage.input_tokens + 2  # "effort low"
    assert low.reasoning.effort == "low"
    # "none" switches thinking off: the prompt closes the tag, the answer is all text
    off = client.responses.create(input="t5 t6", reasoning={"effort": "none"}, **GREEDY)
    assert off.usage.input_tokens == plain.usage.input_tokens + 3  # and </think>
    [message] = off.output
    # not split, the answer is the text as generated (the tokenizer's space before a word)
    assert message.type == "message" and off.output_text == " " + CONTENT
    assert off.usage.output_tokens_details.reasoning_tokens == 0


def test_reasoning_sent_back_reaches_the_template(client):
    """The SDK's way of carrying a conversation on: the last response's output items in
    the next input. The reasoning item is the assistant turn's reasoning_content."""
    first = client.responses.create(input="t5 t6", **GREEDY)
    history = [{"role": "user", "content": "t5 t6"}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    second = client.responses.create(input=[*history, {"role": "user", "content": "t7"}], **GREEDY)
    # t5 t6 | <think> t10 t11 t12 </think> t20 t21 | t7 | <think>
    assert second.usage.input_tokens == 11
    assert second.output_text == CONTENT
    # reasoning that no assistant turn followed is dropped
    dangling = [history[0], history[1], {"role": "user", "content": "t7"}]
    third = client.responses.create(input=dangling, **GREEDY)
    assert third.usage.input_tokens == 4  # t5 t6 | t7 | <think>


@pytest.mark.parametrize(
    "item, words",
    [
        ({"type": "reasoning", "content": [{"type": "text", "text": "t7"}]}, "reasoning_text"),
        ({"type": "reasoning", "summary": [{"type": "summary_text"}]}, "text"),
        ({"type": "reasoning", "content": "t7"}, "array"),
    ],
)
def test_a_bad_reasoning_item_is_a_400_naming_it(served, item, words):
    body = {"model": "tiny", "input": [{"role": "user", "content": "t5"}, item]}
    answer = httpx.post(f"{served}/v1/responses", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "input", error  # the field, as every 400 of this route names it
    assert "input[1]" in error["message"] and words in error["message"], error
    assert "\n" not in error["message"] and "Traceback" not in answer.text


def test_with_several_models_served_the_reasoning_is_split_too(tmp_path):
    """A server holding several models has no one reasoning format: each model's is its
    own (running.reasoning_of), and /v1/responses asks it as the chat route does."""
    from server_fixture import running_server

    thinking, second = tmp_path / "thinking", tmp_path / "second"
    build_answering_model(thinking)
    build_answering_model(second)
    args = ("--model", str(thinking), "--model", str(second), "--kv-cache-memory", "512tok")
    with running_server(*args, "--threads", "1") as url:
        pair = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        response = pair.responses.create(input="t5 t6", **{**GREEDY, "model": "thinking"})
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output_text == CONTENT


def test_ollama_chat_splits_the_thinking(served):
    """Ollama's /api/chat through the ollama client: the thinking in message.thinking,
    whole and streamed, the answer in content; /api/show names the capability."""
    import ollama

    client = ollama.Client(host=served, timeout=120)
    messages = [{"role": "user", "content": "t5 t6"}]
    options = {"temperature": 0, "num_predict": 20}
    answer = client.chat(model="tiny", messages=messages, think=True, options=options)
    assert answer.message.thinking == REASONING and answer.message.content == CONTENT
    parts = list(client.chat(model="tiny", messages=messages, think=True, options=options,
                             stream=True))  # fmt: skip
    assert "".join(p.message.thinking or "" for p in parts) == REASONING
    assert "".join(p.message.content or "" for p in parts) == CONTENT
    generated = client.generate(model="tiny", prompt="t5 t6", think=True, options=options)
    assert generated.thinking == REASONING and generated.response == CONTENT
    assert "thinking" in client.show("tiny").capabilities
