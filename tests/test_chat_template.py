"""Chat templates render exactly as transformers renders them, inside a sandbox, with clear errors."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from tokenmill import hub
from tokenmill.tokenizer import ChatTemplateError, Tokenizer
from tokenmill.tokenizer.chat_template import render_chat_template, validate_messages

# Shaped like Gemma 3's template: whitespace control, raise_exception, roles renamed.
GEMMA_LIKE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{ message['content'] | trim }}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# Shaped like Llama 3's: a date helper, tojson, loop controls and plain (non-dash) block tags.
LLAMA3_LIKE = """{{ bos_token }}{% set date = strftime_now("%Y") %}
{% for message in messages %}
  {% if message.role == 'tool' %}{% continue %}{% endif %}
<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content | trim }}{{ {'n': loop.index, 'text': message.content} | tojson }}<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}{% if date | length != 4 %}{{ raise_exception('no date') }}{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Hello <b>&</b> 你好 "},
    ],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "tool", "content": "{}"},
        {"role": "user", "content": "Thanks 🦙"},
    ],
]


def gguf_template(relative: str) -> str:
    path = hub.cache_dir() / relative
    if not path.exists():
        pytest.skip(f"{path} is missing; run `python scripts/fetch_fixtures.py`")
    return gguf_tokenizer(path).chat_template


@functools.cache
def gguf_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(path)


TEMPLATES = {
    "smollm2": lambda: gguf_template(hub.KNOWN_MODELS["smollm2-135m-instruct"].filename),
    "qwen2": lambda: gguf_template("llama-cpp-vocab/ggml-vocab-qwen2.gguf"),
    "phi-3": lambda: gguf_template("llama-cpp-vocab/ggml-vocab-phi-3.gguf"),
    "gemma-like": lambda: GEMMA_LIKE,
    "llama3-like": lambda: LLAMA3_LIKE,
}


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(name: str, add_generation_prompt: bool) -> None:
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    template = TEMPLATES[name]()
    for messages in CONVERSATIONS:
        if name == "gemma-like" and any(m["role"] == "tool" for m in messages):
            continue  # that template refuses it; see test_template_can_refuse
        ours = render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token="<s>",
            eos_token="</s>",
        )
        (theirs,), _ = utils.render_jinja_template(
            conversations=[messages],
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            bos_token="<s>",
            eos_token="</s>",
        )
        assert ours == theirs


def test_smollm2_prompt_text() -> None:
    path = hub.cache_dir() / hub.KNOWN_MODELS["smollm2-135m-instruct"].filename
    if not path.exists():
        pytest.skip(f"{path} is missing; run `python scripts/fetch_fixtures.py`")
    tok = gguf_tokenizer(path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == tok.encode("<|im_start|>", add_special_tokens=False)[0] == 1
    assert tok.decode(ids) == prompt


def test_bos_token_comes_from_the_model() -> None:
    tok = gguf_tokenizer(vocab("phi-3"))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=False
    )
    assert prompt == "<s><|user|>\nhi<|end|>\n<|assistant|>\n"


def vocab(name: str) -> Path:
    path = hub.cache_dir() / "llama-cpp-vocab" / f"ggml-vocab-{name}.gguf"
    if not path.exists():
        pytest.skip(f"{path} is missing; run `python scripts/fetch_fixtures.py`")
    return path


def test_model_without_template() -> None:
    tok = gguf_tokenizer(vocab("llama-spm"))
    assert tok.chat_template is None
    with pytest.raises(
        ChatTemplateError, match="model ggml-vocab-llama-spm.gguf has no chat template; use plain"
    ):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(tok.encode("plain completion still works"), skip_special_tokens=True) == (
        "plain completion still works"
    )


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hi", "messages must be a non-empty list"),
        ([], "messages must be a non-empty list"),
        (["hi"], r"messages\[0\] must be a dict, not str"),
        (
            [{"content": "hi"}],
            r"messages\[0\]\['role'\] must be one of system, user, assistant, tool; got None",
        ),
        (
            [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}],
            r"messages\[1\]\['role'\].*'bot'",
        ),
        ([{"role": "user"}], r"messages\[0\]\['content'\] must be a string, not NoneType"),
        (
            [{"role": "user", "content": ["a"]}],
            r"messages\[0\]\['content'\] must be a string, not list",
        ),
    ],
)
def test_invalid_messages(messages: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        validate_messages(messages)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=message):
        render_chat_template(GEMMA_LIKE, messages)  # type: ignore[arg-type]


def test_template_can_refuse() -> None:
    messages = [{"role": "assistant", "content": "first"}]
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        render_chat_template(GEMMA_LIKE, messages)


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}",
        "{{ messages[0].update({'role': 'system'}) }}",
    ],
)
def test_templates_are_sandboxed(template: str) -> None:
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        render_chat_template(template, [{"role": "user", "content": "hi"}])


def test_broken_template() -> None:
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat_template("{% for m in messages %}", [{"role": "user", "content": "hi"}])


def test_tojson_keeps_text_as_is() -> None:
    out = render_chat_template(
        "{{ messages[0] | tojson }}", [{"role": "user", "content": "<a href='x'>é</a>"}]
    )
    assert json.loads(out) == {"role": "user", "content": "<a href='x'>é</a>"}
    assert "é" in out and "<a href='x'>" in out


def test_template_from_a_folder(tmp_path: Path) -> None:
    backend = Backend(WordLevel({"<s>": 0, "</s>": 1, "hi": 2, "[UNK]": 3}, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"
    )
    messages = [{"role": "user", "content": "hi"}]
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template(messages) == "<s>hi</s>"

    named = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ eos_token }}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": named}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.apply_chat_template(messages) == "</s>"
    assert tok.encode("hi hi") == [0, 2, 2]
    assert (
        tok.decode([0, 2, 1], skip_special_tokens=False) == "<s> hi </s>"
    )  # library decoder fallback
