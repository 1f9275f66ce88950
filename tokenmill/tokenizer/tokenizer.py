"""The tokenizer every other part of tokenmill talks to, loaded from a GGUF file or an HF folder.

Encoding runs on the Hugging Face `tokenizers` library. We add BOS/EOS ourselves, from the model's
rules, instead of through a post-processor, so both sources behave the same way.

Decoding does not use the library's decoder. Its `ByteFallback` step turns a whole run of `<0xNN>`
pieces into U+FFFD when any byte of the run is invalid, so a byte that arrives later can change
text that was already streamed. Instead every id maps to the bytes it stands for and `decode`
joins them and reads the result as UTF-8, as llama.cpp does. That makes decoding local: text
decoded up to a character boundary never changes, which `IncrementalDetokenizer` relies on. The
byte table is derived from the backend's own decoder description (byte-level or SentencePiece);
a decoder of any other kind falls back to the library's `decode`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from .chat_template import ChatTemplateError, render_chat_template
from .gguf_vocab import load_gguf_vocab

# Special pieces that end a turn; llama.cpp stops on these too when a file names no eot id.
END_OF_TURN_PIECES = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "<end_of_utterance>",
    }
)


class Tokenizer:
    """Text <-> token ids for one model, plus its special tokens and chat template."""

    def __init__(
        self,
        backend: Backend,
        *,
        name: str,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        stop_token_ids: list[int] | tuple[int, ...] = (),
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        """Usually built by `from_gguf` or `from_pretrained`. Takes `backend` over: its
        post-processor, padding and truncation are turned off."""
        backend.post_processor = None  # BOS/EOS are added in `encode`
        backend.no_padding()
        backend.no_truncation()
        self._backend = backend
        self._literal: Backend | None = None  # a copy that leaves special-token text alone
        self.name = name
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = bool(add_bos) and bos_token_id is not None
        self.add_eos = bool(add_eos) and eos_token_id is not None
        self.chat_template = chat_template
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        pieces = _pieces_by_id(backend)
        self.vocab_size = len(pieces)
        self._decoding = _ByteDecoding.of(backend, pieces)
        by_text = {i for i in self._special_ids if added[i].content in END_OF_TURN_PIECES}
        named = {eos_token_id, *stop_token_ids} - {None}
        self.eos_token_ids: list[int] = sorted(named | by_text)

    # --- loading -------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer a GGUF file's `tokenizer.ggml.*` metadata describes."""
        vocab = load_gguf_vocab(path)
        return cls(
            vocab.backend,
            name=Path(path).name,
            bos_token_id=vocab.bos_token_id,
            eos_token_id=vocab.eos_token_id,
            stop_token_ids=vocab.stop_token_ids,
            add_bos=vocab.add_bos,
            add_eos=vocab.add_eos,
            chat_template=vocab.chat_template,
        )

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face checkpoint folder (tokenizer.json and its configs)."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{folder}: no tokenizer.json (tokenmill needs a fast tokenizer)"
            )
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        generation = _read_json(folder / "generation_config.json")

        def token_id(name: str) -> int | None:
            content = _token_content(config.get(name) or special_map.get(name))
            found = backend.token_to_id(content) if content else None
            return found if found is not None else _first_id(generation.get(f"{name}_id"))

        bos, eos = token_id("bos_token"), token_id("eos_token")
        added_by_default = backend.encode("", add_special_tokens=True).ids
        return cls(
            backend,
            name=folder.name,
            bos_token_id=bos,
            eos_token_id=eos,
            stop_token_ids=_as_ids(generation.get("eos_token_id")),
            add_bos=config.get("add_bos_token", bos is not None and added_by_default[:1] == [bos]),
            add_eos=config.get("add_eos_token", eos is not None and added_by_default[-1:] == [eos]),
            chat_template=_hf_chat_template(folder, config),
        )

    # --- text <-> ids --------------------------------------------------------------------------

    def encode(
        self, text: str, add_special_tokens: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids for `text`. Special-token text such as "<|im_start|>" becomes its id unless
        `parse_special` is False; `add_special_tokens` adds BOS/EOS as the model wants."""
        backend = self._backend if parse_special else self._literal_backend()
        ids = backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; incomplete or invalid UTF-8 shows as U+FFFD."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        if self._decoding is None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self._decoding.decode(ids)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special (control) tokens, such as BOS, EOS and <|im_start|>."""
        return self._special_ids

    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for in decoded text, indexed by id (constrained decoding
        matches grammars against these)."""
        if self._decoding is not None:
            return list(self._decoding.token_bytes)
        # An unknown decoder: one id at a time is the best we can do (a partial character
        # comes out as U+FFFD).
        return [self._backend.decode([i]).encode() for i in range(self.vocab_size)]

    def id_to_piece(self, i: int) -> str:
        """The raw vocabulary piece of id `i` (e.g. "ĠHello" or "▁Hello"), for display."""
        piece = self._backend.id_to_token(i) if 0 <= i < self.vocab_size else None
        if piece is None:
            raise ValueError(
                f"token id {i} is not in the vocabulary of {self.name} (size {self.vocab_size})"
            )
        return piece

    # --- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for a conversation, rendered with the model's own chat template
        (with `tools`, function definitions, for a template that renders them)."""
        if self.chat_template is None:
            raise ChatTemplateError(f"model {self.name} has no chat template; use plain completion")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._piece_or_none(self.bos_token_id),
            eos_token=self._piece_or_none(self.eos_token_id),
            tools=tools,
        )

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"

    def _piece_or_none(self, i: int | None) -> str | None:
        return None if i is None else self.id_to_piece(i)

    def _literal_backend(self) -> Backend:
        if self._literal is None:
            literal = Backend.from_str(self._backend.to_str())
            literal.encode_special_tokens = True
            self._literal = literal
        return self._literal


# --- decoding through per-token bytes ---------------------------------------------------------------

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class _ByteDecoding:
    """Decoding as the UTF-8 reading of the concatenated bytes of each token."""

    token_bytes: list[bytes]
    strip_leading_space: bool  # SentencePiece's prepended space, taken off the start of the text

    def decode(self, ids: list[int]) -> str:
        table = self.token_bytes
        if ids and not 0 <= min(ids) <= max(ids) < len(table):
            bad = next(i for i in ids if not 0 <= i < len(table))
            raise ValueError(f"token id {bad} is not in the vocabulary (size {len(table)})")
        text = b"".join([table[i] for i in ids]).decode("utf-8", errors="replace")
        return text[1:] if self.strip_leading_space and text.startswith(" ") else text

    @classmethod
    def of(cls, backend: Backend, pieces: list[str]) -> _ByteDecoding | None:
        """The byte decoding equivalent to `backend`'s decoder, if it is one we know."""
        steps = _decoder_steps(backend)
        kinds = [step["type"] for step in steps]
        if kinds == ["ByteLevel"]:
            added = backend.get_added_tokens_decoder()
            return cls(_byte_level_bytes(pieces, set(added)), strip_leading_space=False)
        if steps and all(_is_sentencepiece_step(step) for step in steps):
            return cls(
                _sentencepiece_bytes(pieces, byte_fallback="ByteFallback" in kinds),
                strip_leading_space=any(_strips_leading_space(step) for step in steps),
            )
        return None


def _pieces_by_id(backend: Backend) -> list[str]:
    vocab = backend.get_vocab(with_added_tokens=True)
    pieces = [""] * (max(vocab.values()) + 1)
    for piece, i in vocab.items():
        pieces[i] = piece
    return pieces


def _decoder_steps(backend: Backend) -> list[dict[str, Any]]:
    if backend.decoder is None:
        return []
    spec = json.loads(backend.decoder.__getstate__())
    return spec["decoders"] if spec["type"] == "Sequence" else [spec]


def _is_sentencepiece_step(step: dict[str, Any]) -> bool:
    kind = step["type"]
    if kind == "Replace":
        return step["pattern"] == {"String": "\u2581"} and step["content"] == " "
    if kind == "Strip":
        return step["content"] == " " and step["stop"] == 0
    if kind == "Metaspace":
        return step["replacement"] == "\u2581"
    return kind in ("ByteFallback", "Fuse")


def _strips_leading_space(step: dict[str, Any]) -> bool:
    if step["type"] == "Strip":
        return step["start"] >= 1
    if step["type"] == "Metaspace":  # older files say add_prefix_space, newer prepend_scheme
        return (
            step.get("prepend_scheme", "always" if step.get("add_prefix_space") else "never")
            != "never"
        )
    return False


def _byte_level_bytes(pieces: list[str], added: set[int]) -> list[bytes]:
    """Undo GPT-2's byte-to-character spelling; added tokens are spelled as plain text."""
    table = str.maketrans({ch: chr(b) for b, ch in _bytes_to_unicode().items()})
    out = []
    for i, piece in enumerate(pieces):
        try:
            out.append(piece.encode() if i in added else piece.translate(table).encode("latin-1"))
        except UnicodeEncodeError:  # not byte-level spelling after all
            out.append(piece.encode())
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), 256),
    ]
    rest = (b for b in range(256) if b not in printable)
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(rest)}


def _sentencepiece_bytes(pieces: list[str], byte_fallback: bool) -> list[bytes]:
    out = [piece.replace("\u2581", " ").encode() for piece in pieces]
    if byte_fallback:
        for i, piece in enumerate(pieces):
            if piece.startswith("<0x") and (byte := _BYTE_PIECE.fullmatch(piece)):
                out[i] = bytes([int(byte[1], 16)])
    return out


# --- Hugging Face folder helpers --------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    """A special token as the configs spell it: a string, or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _first_id(value: Any) -> int | None:
    ids = _as_ids(value)
    return ids[0] if ids else None


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: tokenizer_config.json, or chat_template.jinja/.json beside it."""
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        template = _read_json(folder / "chat_template.json").get("chat_template")
    return template
