"""Tokenizer ids against llama.cpp's own test vectors, and against transformers on real models.

llama.cpp ships vocabulary-only GGUF files with inputs (`.inp`, separated by a
`__ggml_vocab_test__` line) and the ids its tokenizer must produce (`.out`, one line per input).
Its test tokenizes with add_special=false and parse_special=false, so we do the same.
`scripts/fetch_fixtures.py` fetches them into the cache folder.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import gguf
import pytest
from tokenizers.processors import TemplateProcessing

from tokenmill import hub
from tokenmill.tokenizer import Tokenizer
from tokenmill.tokenizer.gguf_vocab import load_gguf_vocab

VOCABS = ("gpt-2", "llama-bpe", "llama-spm", "qwen2", "phi-3")
SEPARATOR = "\n__ggml_vocab_test__\n"


def vocab_path(name: str) -> Path:
    path = hub.cache_dir() / "llama-cpp-vocab" / f"ggml-vocab-{name}.gguf"
    if not path.exists():
        pytest.skip(f"{path} is missing; run `python scripts/fetch_fixtures.py`")
    return path


def model_path(name: str) -> Path:
    path = hub.cache_dir() / hub.KNOWN_MODELS[name].filename
    if not path.exists():
        pytest.skip(f"{path} is missing; run `python scripts/fetch_fixtures.py`")
    return path


def vectors(name: str) -> list[tuple[str, list[int]]]:
    path = vocab_path(name)
    inputs = Path(f"{path}.inp").read_text(encoding="utf-8").split(SEPARATOR)[:-1]
    outputs = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")[: len(inputs)]
    assert len(inputs) == len(outputs) > 0
    return [
        (text, [int(i) for i in ids.split()]) for text, ids in zip(inputs, outputs, strict=True)
    ]


@functools.cache
def load(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(vocab_path(name))


@pytest.fixture(params=VOCABS)
def vocab(request: pytest.FixtureRequest) -> tuple[str, Tokenizer]:
    return request.param, load(request.param)


def mismatches(tok: Tokenizer, pairs: list[tuple[str, list[int]]], **kwargs: bool) -> list[str]:
    return [
        f"{text!r}: expected {ids}, got {got}"
        for text, ids in pairs
        if (got := tok.encode(text, add_special_tokens=False, **kwargs)) != ids
    ]


def test_ids_match_llama_cpp(vocab: tuple[str, Tokenizer]) -> None:
    name, tok = vocab
    pairs = vectors(name)
    assert mismatches(tok, pairs, parse_special=False) == []
    assert mismatches(tok, pairs) == []  # the inputs hold no special-token text


def test_decode_inverts_the_vectors(vocab: tuple[str, Tokenizer]) -> None:
    name, tok = vocab
    assert [(text, tok.decode(ids)) for text, ids in vectors(name) if tok.decode(ids) != text] == []


def test_special_token_text(vocab: tuple[str, Tokenizer]) -> None:
    _, tok = vocab
    eos = tok.id_to_piece(tok.eos_token_id)
    assert tok.encode(f"a{eos}", add_special_tokens=False)[-1] == tok.eos_token_id
    literal = tok.encode(f"a{eos}", add_special_tokens=False, parse_special=False)
    assert tok.eos_token_id not in literal
    assert tok.decode(literal) == f"a{eos}"
    assert (
        tok.decode(tok.encode(f"a{eos}", add_special_tokens=False), skip_special_tokens=True) == "a"
    )


@pytest.mark.parametrize(
    ("name", "bos", "eos_ids"),
    [
        ("gpt-2", None, [50256]),
        ("llama-bpe", 128000, [128001, 128009]),  # <|end_of_text|>, <|eot_id|>
        ("llama-spm", 1, [2]),
        ("qwen2", None, [151643, 151645]),  # <|endoftext|>, <|im_end|>
        ("phi-3", 1, [32000, 32007]),  # <|endoftext|>, <|end|>
    ],
)
def test_bos_and_end_of_generation(name: str, bos: int | None, eos_ids: list[int]) -> None:
    tok = load(name)
    plain = tok.encode("Hello", add_special_tokens=False)
    assert tok.encode("Hello") == ([bos] if bos is not None else []) + plain
    assert tok.eos_token_ids == eos_ids
    assert tok.eos_token_id in eos_ids


def test_vocabulary_bounds() -> None:
    tok = load("llama-spm")
    assert tok.vocab_size == 32000
    assert tok.id_to_piece(15043) == "▁Hello"
    assert tok.id_to_piece(13) == "<0x0A>"
    for bad in (-1, 32000):
        with pytest.raises(ValueError, match="not in the vocabulary"):
            tok.id_to_piece(bad)
        with pytest.raises(ValueError, match="not in the vocabulary"):
            tok.decode([1, bad])


def write_hf_folder(
    folder: Path, gguf: Path, config: dict, *, bos_by_post_processor: bool, generation: dict | None
) -> None:
    """A Hugging Face style folder holding the tokenizer that `gguf` describes."""
    folder.mkdir()
    backend = load_gguf_vocab(gguf).backend
    if bos_by_post_processor:  # as many repos say it, instead of add_bos_token
        bos = config["bos_token"]
        backend.post_processor = TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, backend.token_to_id(bos))]
        )
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))


LLAMA3_CONFIG = {
    "bos_token": {"content": "<|begin_of_text|>", "special": True},
    "eos_token": "<|end_of_text|>",
    "add_bos_token": True,
}
QWEN2_CONFIG = {
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "chat_template": "{{ messages[0].content }}",
}


@pytest.mark.parametrize(
    ("name", "config", "bos_by_post_processor", "generation"),
    [
        ("llama-spm", {"bos_token": "<s>", "eos_token": "</s>"}, True, None),
        ("llama-bpe", LLAMA3_CONFIG, False, {"eos_token_id": [128001, 128008, 128009]}),
        ("qwen2", QWEN2_CONFIG, False, None),
        ("gpt-2", {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}, False, None),
    ],
)
def test_from_pretrained_folder(
    tmp_path: Path, name: str, config: dict, bos_by_post_processor: bool, generation: dict | None
) -> None:
    gguf_tok = load(name)
    write_hf_folder(
        tmp_path / name,
        vocab_path(name),
        config,
        bos_by_post_processor=bos_by_post_processor,
        generation=generation,
    )
    tok = Tokenizer.from_pretrained(tmp_path / name)
    assert tok.name == name
    assert mismatches(tok, vectors(name)) == []
    assert [tok.decode(ids) for _, ids in vectors(name)] == [text for text, _ in vectors(name)]
    assert tok.encode("Hi there") == gguf_tok.encode("Hi there")
    assert tok.vocab_size == gguf_tok.vocab_size
    if generation:
        assert tok.eos_token_ids == generation["eos_token_id"]
    if "chat_template" in config:
        assert tok.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey"


def test_from_pretrained_needs_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


# --- small hand-made vocabularies: what the vector files do not cover ------------------------------


def write_vocab_gguf(
    path: Path, model: str, tokens: list[str], types: list[int], **extra: object
) -> Path:
    """A vocabulary-only GGUF file, like llama.cpp's ggml-vocab-*.gguf."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for key, value in extra.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def byte_level_vocab(tmp_path: Path, pre: str) -> Tokenizer:
    alphabet = [chr(c) for c in range(33, 127)] + [
        chr(256 + b) for b in range(33)
    ]  # ASCII, Ġ, Ċ...
    tokens = [*alphabet, "Ġt", "he", "Ġthe", "<|endoftext|>", "<think>"]
    types = [N] * (len(tokens) - 2) + [CONTROL, USER_DEFINED]
    merges = ["Ġ t", "h e", "Ġt he"]
    path = tmp_path / f"{pre}.gguf"
    write_vocab_gguf(
        path,
        "gpt2",
        tokens,
        types,
        tokenizer_pre=pre,
        token_merges=merges,
        eos_token_id=len(tokens) - 2,
    )
    return Tokenizer.from_gguf(path)


N, CONTROL, USER_DEFINED, BYTE = (
    int(t)
    for t in (
        gguf.TokenType.NORMAL,
        gguf.TokenType.CONTROL,
        gguf.TokenType.USER_DEFINED,
        gguf.TokenType.BYTE,
    )
)


@pytest.mark.parametrize(
    "pre", ["gpt-2", "llama-bpe", "qwen2", "smollm", "gpt-4o", "default", "no-such-pre"]
)
def test_byte_level_pre_tokenizers(
    tmp_path: Path, pre: str, caplog: pytest.LogCaptureFixture
) -> None:
    tok = byte_level_vocab(tmp_path, pre)
    assert (pre == "no-such-pre") == ("unknown tokenizer.ggml.pre 'no-such-pre'" in caplog.text)
    text = "Hello 1234 the world!!\n\n  x's (y) <think> z"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(" the<think>t<|endoftext|>") == [
        tok.vocab_size - 3,
        tok.vocab_size - 1,
        83,
        tok.vocab_size - 2,
    ]
    literal = tok.encode("<|endoftext|><think>", parse_special=False)
    assert literal[-1] == tok.vocab_size - 1  # user-defined pieces are matched even so
    assert tok.vocab_size - 2 not in literal
    assert tok.eos_token_ids == [tok.vocab_size - 2]


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_sentencepiece_space_prefix(tmp_path: Path, add_space_prefix: bool) -> None:
    tokens = [
        "<unk>",
        "<s>",
        "</s>",
        *(f"<0x{b:02X}>" for b in range(256)),
        "▁",
        "h",
        "i",
        "hi",
        "▁hi",
        "  ",
    ]
    types = [2, CONTROL, CONTROL] + [BYTE] * 256 + [N] * 5 + [USER_DEFINED]
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, 0.0]
    path = write_vocab_gguf(
        tmp_path / "spm.gguf",
        "llama",
        tokens,
        types,
        token_scores=scores,
        add_space_prefix=add_space_prefix,
    )
    tok = Tokenizer.from_gguf(path)
    hi, space_hi, spaces = 262, 263, 264
    assert tok.encode("hi hi") == [1, space_hi if add_space_prefix else hi, space_hi]
    # the user-defined "  " is matched whole; like llama.cpp, the text after it gets a space prefix
    after = space_hi if add_space_prefix else hi
    assert tok.encode("hi  hi", add_special_tokens=False)[1:] == [spaces, after]
    assert tok.encode("é", add_special_tokens=False)[-2:] == [3 + 0xC3, 3 + 0xA9]  # byte fallback
    for text in ("hi hi", " hi", "é", ""):
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


# --- real models against transformers (slow: transformers takes ~25 s to load Gemma's vocab) -------

SAMPLES = [
    "Hello world",
    " Hello world",
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it?",
    "def f(x):\n    return x * 2\n\n\nprint(f(3))  # done",
    "if (a && b || !c) { x->y[0] += 0x1F; }",
    "a  b   c    d\t\te\n \n  \n",
    "   leading and trailing   ",
    "中文字符测试，你好世界。日本語のテキスト、한국어 텍스트",
    "emoji 🦙🚀👍🏽 👨‍👩‍👧 ❤️",
    "Ääpfel café naïve Ωmega ſ ﬁ",
    "numbers 1234567890 and 1,000,000.00",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<bos>",
    "https://example.com/path?q=1&r=2#frag",
    "\u00a0nbsp\u2009thin\u200bzero-width",
    "I'm you're they'll WE'VE",
]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_matches_transformers_gguf(model: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    path = model_path(model)
    ours = Tokenizer.from_gguf(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in SAMPLES:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids) == text
    # transformers' own folder format, written by save_pretrained
    theirs.save_pretrained(tmp_path)
    folder = Tokenizer.from_pretrained(tmp_path)
    assert [folder.encode(t) for t in SAMPLES] == [ours.encode(t) for t in SAMPLES]
    assert folder.chat_template == ours.chat_template


@pytest.mark.slow
def test_gemma_loads_in_seconds() -> None:
    import time

    start = time.perf_counter()
    tok = Tokenizer.from_gguf(model_path("gemma-3-270m"))
    assert time.perf_counter() - start < 10
    assert tok.vocab_size == 262144
    assert tok.eos_token_ids == [1, 106]  # <eos>, <end_of_turn>
