"""Hostile model files: every one gives a one-line LoadError naming the file (and the key),
in bounded time and memory. Issue 11, findings 2 and 4.

Each load runs in a sandboxed child (sandbox.py: a fork with RLIMIT_AS and a
timeout), so a regression shows up as a failed case ("timeout", "killed", "crash"),
not as a hung or swapping test run. The cases are the ones the issue found, then
property-based fuzzing (hypothesis) of GGUF headers (bytes and fields), HF config.json
fields and safetensors headers, mutated from real files.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import pytest
from gguf import GGUFValueType as V
from helpers import build_hf_model, write_llama_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sandbox import load_bounded

from tokenmill.loader.gguf_reader import GGUFFile


def _examples(n: int) -> int:
    """n, times $TOKENMILL_FUZZ_SCALE (default 1): CI runs a bounded number of cases, a
    deeper local run sets the scale."""
    return max(1, round(n * float(os.environ.get("TOKENMILL_FUZZ_SCALE", "1"))))


FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _assert_load_error(path: Path, key: str | None, **bounds) -> None:
    outcome = load_bounded(path, **bounds)
    assert outcome.kind == "LoadError", outcome
    assert outcome.acceptable(path), outcome
    if key is not None:
        assert key in outcome.message, outcome


def _assert_acceptable(path: Path, **bounds) -> None:
    outcome = load_bounded(path, **bounds)
    assert outcome.acceptable(path), outcome


# --------------------------------------------------------------------------- GGUF


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_hf_model("llama", tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model, tmp_path_factory) -> tuple[bytes, int]:
    """The tiny model as GGUF bytes, and where its header ends (the first tensor's data)."""
    path = tmp_path_factory.mktemp("gguf") / "base.gguf"
    write_llama_gguf(tiny_model, path)
    return path.read_bytes(), min(t.data_offset for t in GGUFFile(path).tensors)


# (case, {key: (value, type)}, a text the error must contain: the key it names)
GGUF_FIELDS = [
    ("block_count 10^8", {"llama.block_count": (100_000_000, V.UINT32)}, "llama.block_count"),
    ("block_count 1000", {"llama.block_count": (1000, V.UINT32)}, "llama.block_count"),
    ("block_count beyond tensors", {"llama.block_count": (5, V.UINT32)}, "llama.block_count is 5"),
    ("block_count short of tensors", {"llama.block_count": (2, V.UINT32)}, "llama.block_count is 2"),
    ("alignment 0", {"general.alignment": (0, V.UINT32)}, "general.alignment"),
    ("alignment 48", {"general.alignment": (48, V.UINT32)}, "general.alignment"),
    ("alignment string", {"general.alignment": ("32", V.STRING)}, "general.alignment"),
    ("head_count 0", {"llama.attention.head_count": (0, V.UINT32)}, "llama.attention.head_count"),
    ("head_count_kv 0", {"llama.attention.head_count_kv": (0, V.UINT32)}, "head_count_kv"),
    ("head_count_kv 3", {"llama.attention.head_count_kv": (3, V.UINT32)}, "num_kv_heads 3"),
    ("heads above hidden", {"llama.attention.head_count": (128, V.UINT32)}, "head_dim"),
    ("embedding_length 2^40", {"llama.embedding_length": (2**40, V.UINT64)}, "llama.embedding_length"),
    ("embedding_length 128", {"llama.embedding_length": (128, V.UINT32)}, "has shape"),
    ("feed_forward_length 2^31", {"llama.feed_forward_length": (2**31, V.UINT32)}, "feed_forward_length"),
    ("context_length 2^62", {"llama.context_length": (2**62, V.UINT64)}, "llama.context_length"),
    ("context_length string", {"llama.context_length": ("4096", V.STRING)}, "llama.context_length"),
    ("context_length array", {"llama.context_length": ([1, 2], V.ARRAY)}, "llama.context_length"),
    ("rope base nan", {"llama.rope.freq_base": (math.nan, V.FLOAT32)}, "llama.rope.freq_base"),
    ("rope base 0", {"llama.rope.freq_base": (0.0, V.FLOAT32)}, "llama.rope.freq_base"),
    ("rope dims odd", {"llama.rope.dimension_count": (7, V.UINT32)}, "rotary"),
    ("rms eps -1", {"llama.attention.layer_norm_rms_epsilon": (-1.0, V.FLOAT32)}, "rms_epsilon"),
    ("architecture number", {"general.architecture": (7, V.UINT32)}, "unsupported architecture"),
    ("no embedding_length", {"llama.embedding_length": None}, "llama.embedding_length"),
    ("tokens number", {"tokenizer.ggml.tokens": (5, V.UINT32)}, "tokenizer.ggml.tokens"),
    ("scores short", {"tokenizer.ggml.scores": ([0.0, 1.0], V.ARRAY)}, "tokenizer.ggml.scores"),
    ("token types short", {"tokenizer.ggml.token_type": ([1], V.ARRAY)}, "token_type"),
    ("template number", {"tokenizer.chat_template": (3, V.UINT32)}, "tokenizer.chat_template"),
    ("eos id -1", {"tokenizer.ggml.eos_token_id": (-1, V.INT32)}, "eos_token_id"),
    ("bos id string", {"tokenizer.ggml.bos_token_id": ("1", V.STRING)}, "bos_token_id"),
    ("add_bos number", {"tokenizer.ggml.add_bos_token": (2, V.UINT32)}, "add_bos_token"),
]  # fmt: skip


@pytest.mark.parametrize(
    "metadata, key", [c[1:] for c in GGUF_FIELDS], ids=[c[0] for c in GGUF_FIELDS]
)
def test_gguf_field(tmp_path, tiny_model, metadata, key):
    path = tmp_path / "model.gguf"
    write_llama_gguf(tiny_model, path, metadata=metadata)
    _assert_load_error(path, key)


def test_cli_refuses_a_hostile_file_in_one_line(tmp_path, tiny_model):
    """Finding 2 from the command line: `tokenmill generate` on a file claiming 10^8 layers
    ends at once with one line (it used to run for minutes into gigabytes)."""
    import subprocess
    import sys

    path = tmp_path / "model.gguf"
    write_llama_gguf(tiny_model, path, metadata={"llama.block_count": (100_000_000, V.UINT32)})
    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "generate", "hi", "--model", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[-1].startswith("tokenmill: error:") and "llama.block_count" in lines[-1]


def _u64_at(data: bytearray, offset: int, value: int) -> None:
    data[offset : offset + 8] = struct.pack("<Q", value)


def _flipped(data: bytes, offset: int) -> int:
    """A little-endian u64 with its byte order reversed (a writer with the wrong endianness)."""
    return struct.unpack(">Q", data[offset : offset + 8])[0]


def _value_offset(data: bytes, key: str) -> int:
    """Offset of what follows key `key` and its value type in a GGUF header."""
    at = data.index(key.encode())
    return at + len(key) + 4


@pytest.fixture(scope="module")
def real_gguf(smollm_path, tmp_path_factory) -> Path:
    """A copy of the real SmolLM2 file, its header to be mutated (and restored) in place."""
    path = tmp_path_factory.mktemp("real") / "smollm.gguf"
    shutil.copyfile(smollm_path, path)
    return path


class _Mutated:
    """Change bytes of a file for the length of a `with`."""

    def __init__(self, path: Path, mutate):
        self.path, self.mutate = path, mutate

    def __enter__(self) -> Path:
        with open(self.path, "rb") as f:
            self.original = f.read(8 << 20)  # the header lies in the first megabytes
        data = bytearray(self.original)
        self.mutate(data)
        with open(self.path, "r+b") as f:
            f.write(data)
        return self.path

    def __exit__(self, *exc) -> None:
        with open(self.path, "r+b") as f:
            f.write(self.original)


# In the real file: (case, mutation, key). The counts are checked against the bytes left
# before anything is allocated: the reader used to fill ~900 MiB of strings first, which
# the 256 MiB limit below turns into a failure.
REAL_GGUF_BYTES = [
    ("tensor count flipped", lambda d: _u64_at(d, 8, _flipped(d, 8)), "tensor count"),
    ("kv count flipped", lambda d: _u64_at(d, 16, _flipped(d, 16)), "key/value count"),
    ("kv count +1", lambda d: _u64_at(d, 16, struct.unpack_from("<Q", d, 16)[0] + 1), None),
    (
        "string length flipped",
        lambda d: _u64_at(d, o := _value_offset(d, "general.architecture"), _flipped(d, o)),
        "string",
    ),
    (
        "token array count flipped",
        lambda d: _u64_at(d, o := _value_offset(d, "tokenizer.ggml.tokens") + 4, _flipped(d, o)),
        "tokenizer.ggml.tokens",
    ),
    (  # the name runs on over the next tensors' binary infos (newlines and all)
        "tensor name length 1043",
        lambda d: _u64_at(d, d.index(b"token_embd.weight") - 8, 1043),
        "tensor",
    ),
    (
        "merges count 2^40",
        lambda d: _u64_at(d, _value_offset(d, "tokenizer.ggml.merges") + 4, 2**40),
        "tokenizer.ggml.merges",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "mutate, key", [c[1:] for c in REAL_GGUF_BYTES], ids=[c[0] for c in REAL_GGUF_BYTES]
)
def test_real_gguf_header_bytes(real_gguf, mutate, key):
    with _Mutated(real_gguf, mutate) as path:
        _assert_load_error(path, key, memory_bytes=256 << 20, timeout_s=60)


@pytest.mark.slow
@settings(FUZZ, max_examples=_examples(15))
@given(data=st.data())
def test_fuzz_real_gguf_header(real_gguf, data):
    """Extreme u32/u64 values in the real file's structure: the model's keys (before the
    vocabulary) and the tensor infos (dimensions, types, offsets)."""
    header = real_gguf.read_bytes()[: 8 << 20]
    tensors = GGUFFile(real_gguf).tensors
    info_start = header.index(tensors[0].name.encode()) - 8
    vocab_start = header.index(b"tokenizer.ggml.tokens")
    at = data.draw(
        st.integers(8, vocab_start - 8)
        | st.integers(info_start, min(t.data_offset for t in tensors) - 8),
        label="offset",
    )
    size = data.draw(st.sampled_from([4, 8]), label="size")
    value = data.draw(
        st.sampled_from([0, 1, 2**31 - 1, 2 ** (8 * size) - 1])
        | st.integers(0, 2 ** (8 * size) - 1),
        label="value",
    )

    def mutate(raw: bytearray) -> None:
        raw[at : at + size] = value.to_bytes(size, "little")

    with _Mutated(real_gguf, mutate) as path:
        _assert_acceptable(path, timeout_s=120, memory_bytes=2 << 30)


@settings(FUZZ, max_examples=_examples(40))
@given(data=st.data())
def test_fuzz_gguf_header_bytes(tmp_path_factory, tiny_gguf, data):
    """Random bytes, extreme u32/u64 values and truncation anywhere in a GGUF header."""
    raw, header_end = bytearray(tiny_gguf[0]), tiny_gguf[1]
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        kind = data.draw(st.sampled_from(["bytes", "u32", "u64", "truncate"]), label="kind")
        at = data.draw(st.integers(0, header_end - 8), label="offset")
        if kind == "bytes":
            raw[at : at + 4] = data.draw(st.binary(min_size=1, max_size=4), label="bytes")
        elif kind == "truncate":
            raw = raw[:at]
        else:
            size = 4 if kind == "u32" else 8
            extreme = [0, 1, 2**31 - 1, 2 ** (8 * size) - 1, 2 ** (8 * size - 1)]
            value = data.draw(st.sampled_from(extreme) | st.integers(0, 2 ** (8 * size) - 1))
            raw[at : at + size] = value.to_bytes(size, "little")
    path = tmp_path_factory.mktemp("fuzz") / "mutated.gguf"
    path.write_bytes(bytes(raw))
    _assert_acceptable(path, timeout_s=60)


_HOSTILE_NUMBERS = [0, 1, 3, -1, 2**31, 2**32 - 1, 2**63 - 1, 10**8, 1e30, math.inf, math.nan]
_GGUF_KEYS = [
    "llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
    "llama.attention.head_count", "llama.attention.head_count_kv", "llama.context_length",
    "llama.attention.key_length", "llama.rope.dimension_count", "llama.rope.freq_base",
    "llama.vocab_size", "general.alignment", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_space_prefix", "general.architecture",
    "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
    "tokenizer.ggml.model", "tokenizer.chat_template",
]  # fmt: skip


def _typed(value) -> tuple:
    if isinstance(value, bool):
        return value, V.BOOL
    if isinstance(value, float):
        return value, V.FLOAT32 if abs(value) < 3e38 or not math.isfinite(value) else V.FLOAT64
    if isinstance(value, int):
        if value < 0:
            return value, V.INT64
        return value, V.UINT32 if value < 2**32 else V.UINT64
    if isinstance(value, str):
        return value, V.STRING
    return value, V.ARRAY


@settings(FUZZ, max_examples=_examples(40))
@given(
    key=st.sampled_from(_GGUF_KEYS),
    value=st.sampled_from(_HOSTILE_NUMBERS)
    | st.text(max_size=8)
    | st.booleans()
    | st.lists(st.integers(0, 5), min_size=1, max_size=3)  # the writer takes no empty array
    | st.just(None),
)
def test_fuzz_gguf_fields(tmp_path_factory, tiny_model, key, value):
    """One header key set to a hostile value (or removed)."""
    path = tmp_path_factory.mktemp("fuzz") / "model.gguf"
    write_llama_gguf(tiny_model, path, metadata={key: None if value is None else _typed(value)})
    _assert_acceptable(path, timeout_s=60)


# --------------------------------------------------------------------------- HF folders


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf_base")
    build_hf_model("llama", folder)
    return folder


def _edited(hf_folder: Path, folder: Path, edit) -> Path:
    """A copy of the tiny HF checkpoint with config.json replaced by edit(config)."""
    shutil.copytree(hf_folder, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(config)))
    return folder


def _set(key, value):
    return lambda config: {**config, key: value}


HF_CONFIGS = [
    ("heads 0", _set("num_attention_heads", 0), "num_attention_heads"),
    ("a list", lambda config: [config], "must hold a JSON object, not list"),
    ("hidden 'x'", _set("hidden_size", "x"), "hidden_size"),
    ("hidden -1", _set("hidden_size", -1), "hidden_size"),
    ("hidden 1e30", _set("hidden_size", 1e30), "hidden_size"),
    ("layers 10^8", _set("num_hidden_layers", 10**8), "num_hidden_layers"),
    ("layers beyond tensors", _set("num_hidden_layers", 5), "num_hidden_layers is 5"),
    ("vocab 10^9", _set("vocab_size", 10**9), "vocab_size"),
    ("positions 2^40", _set("max_position_embeddings", 2**40), "max_position_embeddings"),
    ("kv heads 3", _set("num_key_value_heads", 3), "num_kv_heads 3"),
    ("head_dim odd", _set("head_dim", 7), "head_dim"),
    ("rope_parameters 'x'", _set("rope_parameters", "x"), "rope_parameters"),
    ("rope factor 0", _set("rope_parameters", {"rope_type": "linear", "factor": 0}), "factor"),
    ("rope theta 'nan'", _set("rope_parameters", {"rope_theta": "nan"}), "rope_theta"),
    ("rope_scaling 'x' (4.x)", lambda c: {**_set("rope_parameters", None)(c), "rope_scaling": "x"}, "rope_scaling"),
    ("eos 'x'", _set("eos_token_id", "x"), "eos_token_id"),
    ("bias 'yes'", _set("attention_bias", "yes"), "attention_bias"),
    ("no hidden", lambda config: {k: v for k, v in config.items() if k != "hidden_size"}, "hidden_size"),
]  # fmt: skip


@pytest.mark.parametrize("edit, key", [c[1:] for c in HF_CONFIGS], ids=[c[0] for c in HF_CONFIGS])
def test_hf_config(tmp_path, hf_folder, edit, key):
    _assert_load_error(_edited(hf_folder, tmp_path / "m", edit), key)


def test_hf_generation_config_and_index(tmp_path, hf_folder):
    folder = _edited(hf_folder, tmp_path / "gen", lambda c: c)
    (folder / "generation_config.json").write_text('{"eos_token_id": ["x"]}')
    _assert_load_error(folder, "eos_token_id")
    folder = _edited(hf_folder, tmp_path / "index", lambda c: c)
    index = {"weight_map": {"model.embed_tokens.weight": "../../etc/passwd"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _assert_load_error(folder, "not a file in the folder")


_CONFIG_KEYS = [
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "head_dim", "tie_word_embeddings", "bos_token_id",
    "eos_token_id", "model_type", "attention_bias", "mlp_bias",
]  # fmt: skip
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.sampled_from(_HOSTILE_NUMBERS[:-2]) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip


@settings(FUZZ, max_examples=_examples(40))
@given(key=st.sampled_from(_CONFIG_KEYS), value=_JSON_VALUES)
def test_fuzz_hf_config(tmp_path_factory, hf_folder, key, value):
    if isinstance(value, float) and not math.isfinite(value):
        value = str(value)  # JSON has no NaN or Infinity; their spelling as text stays hostile
    folder = _edited(hf_folder, tmp_path_factory.mktemp("cfg") / "m", _set(key, value))
    _assert_acceptable(folder, timeout_s=60)


@settings(FUZZ, max_examples=_examples(30))
@given(data=st.data())
def test_fuzz_safetensors_header(tmp_path_factory, hf_folder, data):
    """The JSON header of model.safetensors: a tensor's dtype, shape or offsets changed,
    the header's length prefix changed, or random bytes in it."""
    folder = tmp_path_factory.mktemp("st") / "m"
    shutil.copytree(hf_folder, folder)
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    names = sorted(k for k in header if k != "__metadata__")
    kind = data.draw(st.sampled_from(["field", "length", "bytes"]), label="kind")
    if kind == "field":
        name = data.draw(st.sampled_from(names), label="tensor")
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]), label="field")
        header[name][field] = data.draw(
            st.sampled_from(["F64", "I8", "BOOL", "X", "", 3])
            if field == "dtype"
            else st.lists(st.sampled_from([0, 1, 7, 2**31, 2**62, -1]), max_size=4),
            label="value",
        )
        body = json.dumps(header).encode()
        raw = struct.pack("<Q", len(body)) + body + raw[8 + size :]
    elif kind == "length":
        value = data.draw(st.sampled_from([0, 1, size - 1, size + 1, 2**31, 2**64 - 1]))
        raw = struct.pack("<Q", value) + raw[8:]
    else:
        at = data.draw(st.integers(8, 8 + size - 1), label="offset")
        raw = raw[:at] + data.draw(st.binary(min_size=1, max_size=3)) + raw[at + 3 :]
    path.write_bytes(raw)
    _assert_acceptable(folder, timeout_s=60)
