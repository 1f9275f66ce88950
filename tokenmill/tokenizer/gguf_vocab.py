"""Build a Hugging Face `tokenizers.Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF file carries no `tokenizer.json`, only llama.cpp's description of the vocabulary: the
pieces, their types and scores, the BPE merges, and the name of the pre-tokenizer. We rebuild the
tokenizer llama.cpp would run from that, on top of the `tokenizers` library, so that our ids equal
llama.cpp's (checked against llama.cpp's own test vectors in tests/test_tokenizer_vectors.py):

- `gpt2` vocabularies are byte-level BPE. `tokenizer.ggml.pre` names the regular expressions that
  split text into words before merging; the table below copies them from llama.cpp's
  `llama-vocab.cpp`.
- `llama` vocabularies are SentencePiece BPE. llama.cpp merges adjacent pieces best score first;
  that is a BPE whose merge list is every split of every piece, ranked by the score of the piece
  it makes. Spaces become U+2581, one is prepended when `add_space_prefix` says so, and characters
  missing from the vocabulary fall back to their `<0xNN>` byte pieces.
- Control and unknown pieces become special tokens (matched in text unless the caller asks not to
  parse special tokens); user-defined pieces (Gemma's whitespace runs, `<think>`...) are always
  matched whole, as llama.cpp does.

The metadata comes from tokenmill's own fast reader (`loader/gguf_reader.py`), not `gguf.GGUFReader`
(8-15 s for Gemma's 262k-piece vocabulary).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from tokenmill.loader.gguf_reader import read_metadata

log = logging.getLogger(__name__)

# --- pre-tokenizers --------------------------------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp applies a name's expressions one after the other, each splitting the pieces of the last.
_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"), (_GPT2,)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), (_QWEN2,)),
    **dict.fromkeys(("gpt-4o", "llama4"), (_GPT4O,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        (r"\p{N}", _GPT2),
    ),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
}
# llama.cpp keeps a word whole when the word itself is a piece, before trying any merge.
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"}
_ADD_BOS = _IGNORE_MERGES  # pre-tokenizers after which llama.cpp adds BOS unless the file says


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    splits = _SPLITS.get(pre)
    if splits is None:
        log.warning("unknown tokenizer.ggml.pre %r; splitting words as GPT-2 does", pre)
        splits = (_GPT2,)
    steps = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in splits]
    return pre_tokenizers.Sequence(
        [*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


# --- the vocabulary ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFVocab:
    """What `Tokenizer` needs from a GGUF file."""

    backend: Backend  # with normalizer, pre-tokenizer, decoder and added tokens set
    bos_token_id: int | None
    eos_token_id: int | None
    stop_token_ids: list[int]  # eos, eot and eom, as the metadata names them
    add_bos: bool
    add_eos: bool
    chat_template: str | None


MAX_VOCAB = 1 << 22  # as config.MAX_SIZES["vocab_size"]
MAX_SENTENCEPIECE_PIECE = 1024  # characters; merges cost the square of a piece's length


def load_gguf_vocab(path: str | Path) -> GGUFVocab:
    """The tokenizer a GGUF file describes (the file may hold weights or be vocabulary-only).
    Raises ValueError naming the file and the key for metadata no real vocabulary has."""
    meta = _checked(read_metadata(path), path)
    pieces: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not pieces:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens; the file carries no vocabulary")
    types = np.asarray(
        meta.get("tokenizer.ggml.token_type", np.full(len(pieces), TokenType.NORMAL))
    )
    model = meta.get("tokenizer.ggml.model")
    if model == "gpt2":
        backend = _byte_level(pieces, meta)
        add_bos = meta.get("tokenizer.ggml.pre") in _ADD_BOS
    elif model == "llama":
        backend = _sentencepiece(pieces, types, meta)
        add_bos = True
    else:
        raise ValueError(f"{path}: tokenizer.ggml.model {model!r} is not supported (gpt2, llama)")
    _add_special_pieces(backend, pieces, types)

    ids = {name: _token_id(meta, name, len(pieces), model) for name in ("bos", "eos", "eot", "eom")}
    return GGUFVocab(
        backend=backend,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        stop_token_ids=sorted({i for k, i in ids.items() if k != "bos" and i is not None}),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos)) and ids["bos"] is not None,
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)) and ids["eos"] is not None,
        chat_template=meta.get("tokenizer.chat_template"),
    )


# Keys `_checked` verifies the type of (arrays are checked against the vocabulary's length).
_STRING_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
_FLAG_KEYS = (
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix",
)
_ID_KEYS = tuple(f"tokenizer.ggml.{n}_token_id" for n in ("bos", "eos", "eot", "eom", "unknown"))


def _checked(meta: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """`meta` if every tokenizer key holds what llama.cpp expects there; else ValueError."""

    def fail(key: str, wanted: str) -> ValueError:
        return ValueError(f"{path}: {key} must be {wanted}")

    pieces = meta.get("tokenizer.ggml.tokens")
    if pieces is not None:
        if not isinstance(pieces, list) or not all(isinstance(p, str) for p in pieces):
            raise fail("tokenizer.ggml.tokens", "an array of strings")
        if len(pieces) > MAX_VOCAB:
            raise fail("tokenizer.ggml.tokens", f"at most {MAX_VOCAB} pieces, not {len(pieces)}")
    n = len(pieces or [])
    for key, kind in (("tokenizer.ggml.token_type", "i"), ("tokenizer.ggml.scores", "f")):
        value = meta.get(key)
        if value is None:
            continue
        ok = isinstance(value, np.ndarray) and value.ndim == 1 and len(value) == n
        if not ok or value.dtype.kind not in ("iu" if kind == "i" else "fiu"):
            raise fail(key, f"an array of {n} {'integers' if kind == 'i' else 'numbers'}")
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None and (
        not isinstance(merges, list) or not all(isinstance(m, str) for m in merges)
    ):
        raise fail("tokenizer.ggml.merges", "an array of strings")
    for key in _STRING_KEYS:
        if key in meta and not isinstance(meta[key], str):
            raise fail(key, "a string")
    for key in _FLAG_KEYS:
        if key in meta and not isinstance(meta[key], (bool, np.bool_)):
            raise fail(key, "a bool")
    for key in _ID_KEYS:
        value = meta.get(key)
        if value is not None and not isinstance(value, (int, np.integer)):
            raise fail(key, "an integer")
    return meta


# llama.cpp's ids for SentencePiece files that do not name them (older Llama conversions).
_SENTENCEPIECE_DEFAULT_IDS = {"unknown": 0, "bos": 1, "eos": 2}


def _token_id(meta: dict[str, Any], name: str, n_vocab: int, model: str) -> int | None:
    default = _SENTENCEPIECE_DEFAULT_IDS.get(name) if model == "llama" else None
    value = meta.get(f"tokenizer.ggml.{name}_token_id", default)
    return int(value) if value is not None and 0 <= int(value) < n_vocab else None


def _add_special_pieces(backend: Backend, pieces: Sequence[str], types: np.ndarray) -> None:
    """Match control/unknown pieces as special tokens and user-defined ones as plain added tokens."""
    special = np.flatnonzero((types == TokenType.CONTROL) | (types == TokenType.UNKNOWN))
    backend.add_special_tokens(
        [AddedToken(pieces[i], special=True, normalized=False) for i in special]
    )
    user = np.flatnonzero(types == TokenType.USER_DEFINED)
    backend.add_tokens([AddedToken(pieces[i], special=False, normalized=False) for i in user])


def _byte_level(pieces: list[str], meta: dict[str, Any]) -> Backend:
    pre = meta.get("tokenizer.ggml.pre", "default")
    model = BPE(
        vocab={p: i for i, p in enumerate(pieces)},
        merges=[_split_merge(m) for m in meta.get("tokenizer.ggml.merges", [])],
        ignore_merges=pre in _IGNORE_MERGES,
    )
    backend = Backend(model)
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _split_merge(merge: str) -> tuple[str, str]:
    cut = merge.find(" ", 1)  # as llama.cpp reads it: the left piece may itself be a space
    return merge[:cut], merge[cut + 1 :]


def _sentencepiece(pieces: list[str], types: np.ndarray, meta: dict[str, Any]) -> Backend:
    scores = np.asarray(meta.get("tokenizer.ggml.scores", np.zeros(len(pieces))), dtype=np.float64)
    unk = _token_id(meta, "unknown", len(pieces), "llama")
    model = BPE(
        vocab={p: i for i, p in enumerate(pieces)},
        merges=_merges_by_score(pieces, types, scores),
        unk_token=pieces[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = Backend(model)
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", "\u2581")
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), spaces])
        backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    else:
        backend.normalizer = spaces
        backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_by_score(
    pieces: list[str], types: np.ndarray, scores: np.ndarray
) -> list[tuple[str, str]]:
    """Every (left, right) split of every normal piece, the best-scoring result first."""
    normal = np.flatnonzero(types == TokenType.NORMAL).tolist()
    longest = max((len(pieces[i]) for i in normal), default=0)
    if longest > MAX_SENTENCEPIECE_PIECE:
        raise ValueError(
            f"a vocabulary piece is {longest} characters long (at most {MAX_SENTENCEPIECE_PIECE})"
        )
    known = {pieces[i] for i in normal}
    splits, owners = [], []
    for i in normal:
        piece = pieces[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in known and right in known:
                splits.append((left, right))
                owners.append(i)
    # llama.cpp breaks ties between equal scores by position in the text, which a merge list cannot
    # express; the piece id is the closest stable order.
    owner = np.array(owners, dtype=np.int64)
    return [splits[k] for k in np.lexsort((owner, -scores[owner])).tolist()]
