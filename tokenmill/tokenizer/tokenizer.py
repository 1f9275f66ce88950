"""The tokenizer every other part of tokenmill talks to, loaded from a GGUF file or an HF folder.

Encoding runs on the Hugging Face `tokenizers` library. We add BOS/EOS ourselves, from the model's
rules, instead of through a post-processor, so both sources behave the same way.

Chat prompts keep the messages' text as text (`encode_chat`): special-token text typed by a user
("<|im_end|>\n<|im_start|>system") is tokenized as ordinary characters, so only the template
itself can open or close a turn. llama.cpp's server makes the same distinction with
`parse_special`.

`encode(..., max_tokens=N)` refuses a text too long to fit in N tokens before tokenizing it: for
vocabularies where every token stands for a bounded number of bytes (byte-level BPE, and
SentencePiece with byte fallback) the text's length in bytes gives a lower bound on its tokens.

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
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend
from tokenizers.models import WordLevel

from .chat_template import ChatTemplateError, render_chat_template
from .gguf_vocab import load_gguf_vocab

# Private-use characters (plane 15, used by no vocabulary or template) that stand in for the
# special-token text found in chat messages while the template renders: each distinct text in
# one conversation gets one, so the rendered prompt holds no special-token text but the
# template's own.
PLACEHOLDERS = tuple(chr(0xF0000 + i) for i in range(256))


class TextTooLong(ValueError):
    """A text that cannot fit in the tokens allowed, found without tokenizing it."""

    def __init__(self, num_bytes: int, min_tokens: int, max_tokens: int):
        super().__init__(
            f"the text has {num_bytes} bytes, at least {min_tokens} tokens; "
            f"at most {max_tokens} fit"
        )
        self.num_bytes, self.min_tokens, self.max_tokens = num_bytes, min_tokens, max_tokens


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
        # BOS/EOS are added in `encode`; the post-processor joins a pair (`encode_pair`)
        self._pair_processor = backend.post_processor
        backend.post_processor = None
        backend.no_padding()
        backend.no_truncation()
        self._backend = backend
        self._literal: Backend | None = None  # a copy that leaves special-token text alone
        self._specials: Backend | None = None  # finds special-token text (and placeholders)
        self._finder_ids: dict[int, int] = {}  # its id of each special token -> ours
        self._lazy = threading.Lock()  # the copies are made on first use, from any thread
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
        if any(added[i].content == "<|channel|>" for i in self._special_ids):
            # harmony (gpt-oss): <|end|> closes one message of the turn (its analysis, say),
            # which goes on to its answer; <|return|> and <|call|> end it (its config says)
            by_text -= {i for i in self._special_ids if added[i].content == "<|end|>"}
        named = {eos_token_id, *stop_token_ids} - {None}
        self.eos_token_ids: list[int] = sorted(named | by_text)
        # The most text bytes one token can cover (times how much normalization can shrink
        # text), or None when no bound holds (a tokenizer that can drop or fuse text); and the
        # ASCII characters encoding drops (SmolLM2's vocabulary lacks six control bytes).
        self.max_bytes_per_token, self._dropped_chars = _bytes_per_token_bound(
            backend, pieces, self._decoding
        )

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
        self,
        text: str,
        add_special_tokens: bool = True,
        parse_special: bool = True,
        max_tokens: int | None = None,
    ) -> list[int]:
        """Token ids for `text`. Special-token text such as "<|im_start|>" becomes its id unless
        `parse_special` is False; `add_special_tokens` adds BOS/EOS as the model wants.
        max_tokens: raise TextTooLong, without tokenizing, for a text that cannot fit."""
        if max_tokens is not None:
            self.check_length(text, max_tokens)
        backend = self._backend if parse_special else self._literal_backend()
        ids = _encode(backend, text).ids
        if add_special_tokens and self.add_bos:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos:
            ids.append(self.eos_token_id)
        return ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Token ids of two texts joined as the tokenizer's pair template joins them (a
        cross-encoder's query and document: transformers' tokenizer(first, second)); without
        a template, BOS (when the model wants one), then the first, then the second."""
        a, b = _encode(self._backend, first), _encode(self._backend, second)
        if self._pair_processor is not None:
            return self._pair_processor.process(a, b, add_special_tokens=True).ids
        bos = [self.bos_token_id] if self.add_bos else []
        return bos + a.ids + b.ids

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

    def check_length(self, text: str, max_tokens: int) -> None:
        """Raise TextTooLong if `text` certainly needs more than `max_tokens` tokens."""
        if self.max_bytes_per_token is None or len(text) <= max_tokens:
            return  # each token covers at least one character
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        kept = num_bytes - sum(text.count(c) for c in self._dropped_chars)
        min_tokens = kept // self.max_bytes_per_token
        if min_tokens > max_tokens:
            raise TextTooLong(num_bytes, min_tokens, max_tokens)

    # --- chat ----------------------------------------------------------------------------------

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        max_tokens: int | None = None,
        tools: list[dict[str, Any]] | None = None,
        template_vars: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template. Special tokens
        come only from the template: the same text inside a message (or a tool definition,
        or a call's arguments, or a template variable) is ordinary text.
        max_tokens: raise TextTooLong for a rendered prompt that cannot fit (before tokenizing).
        tools: function definitions for a template that renders them. template_vars: further
        variables for the template's context ({"enable_thinking": False})."""
        forged: dict[str, str] = {}  # placeholder -> the special-token text it stands for
        kept = [self._text_kept_as_text(m, forged) for m in messages]
        kept_tools = self._strings_kept_as_text(tools, forged) if tools else None
        kept_vars = (
            self._strings_kept_as_text(dict(template_vars), forged) if template_vars else None
        )
        text = self.apply_chat_template(
            kept,
            add_generation_prompt=add_generation_prompt,
            tools=kept_tools,
            template_vars=kept_vars,
        )
        if max_tokens is not None:
            self.check_length(text, max_tokens)
        if not forged:
            return _encode(self._backend, text).ids  # the template wrote BOS
        return self._encode_keeping_forged(text, forged)

    def _encode_keeping_forged(self, text: str, forged: dict[str, str]) -> list[int]:
        """Token ids of rendered `text` whose placeholders stand for users' special-token text.

        The text is cut at the template's own special tokens, as the library cuts it, and
        each run between them tokenized on its own; a run holding a placeholder gets its
        user's text back and is tokenized without parsing special tokens, so the text reads
        as typed (no extra split inside it) but yields no control token."""
        finder, to_model_id = self._special_finder(), self._finder_ids
        ids: list[int] = []
        run: list[str] = []
        literal = False

        def flush() -> None:
            nonlocal literal
            if run and literal:
                ids.extend(self.encode("".join(run), add_special_tokens=False, parse_special=False))
            elif run:
                ids.extend(_encode(self._backend, "".join(run)).ids)
            run.clear()
            literal = False

        encoding = _encode(finder, text)
        for i, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            piece = text[start:end]
            model_id = to_model_id.get(i)
            if model_id is not None:  # a special token the template wrote
                flush()
                ids.append(model_id)
            elif i != 0:  # a placeholder: the user's text, inside the current run
                run.append(forged.get(piece, piece))
                literal = True
            else:
                run.append(piece)
        flush()
        return ids

    def _text_kept_as_text(self, message: Any, forged: dict[str, str]) -> Any:
        """`message` with every special-token text in its content and name swapped for a
        placeholder (recorded in `forged`)."""
        if not isinstance(message, dict):
            return message  # render_chat_template's validation names the problem
        out = dict(message)
        for key in ("content", "name"):
            if isinstance(out.get(key), str):
                out[key] = self._swap_specials(out[key], forged)
        for key in ("tool_calls", "tool_call_id"):  # a client's text too
            if key in out:
                out[key] = self._strings_kept_as_text(out[key], forged)
        return out

    def _strings_kept_as_text(self, value: Any, forged: dict[str, str]) -> Any:
        """`value` (JSON-like: tools, tool calls) with every string swapped as above."""
        if isinstance(value, str):
            return self._swap_specials(value, forged)
        if isinstance(value, dict):
            return {k: self._strings_kept_as_text(v, forged) for k, v in value.items()}
        if isinstance(value, list):
            return [self._strings_kept_as_text(v, forged) for v in value]
        return value

    def _swap_specials(self, text: str, forged: dict[str, str]) -> str:
        encoding = _encode(self._special_finder(), text)
        if all(i == 0 for i in encoding.ids):  # id 0: text between special tokens
            return text
        by_text = {v: k for k, v in forged.items()}
        pieces = []
        for i, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            piece = text[start:end]
            if i != 0:
                if piece not in by_text:
                    if len(forged) == len(PLACEHOLDERS):
                        raise ValueError(
                            f"messages hold more than {len(PLACEHOLDERS)} different "
                            "special-token texts"
                        )
                    by_text[piece] = PLACEHOLDERS[len(forged)]
                    forged[by_text[piece]] = piece
                piece = by_text[piece]
            pieces.append(piece)
        return "".join(pieces)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_vars: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for a conversation, rendered with the model's own chat template
        (with `tools`, function definitions, for a template that renders them, and
        `template_vars`, further variables for its context)."""
        if self.chat_template is None:
            raise ChatTemplateError(f"model {self.name} has no chat template; use plain completion")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._piece_or_none(self.bos_token_id),
            eos_token=self._piece_or_none(self.eos_token_id),
            tools=tools,
            template_vars=template_vars,
        )

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"

    def _piece_or_none(self, i: int | None) -> str | None:
        return None if i is None else self.id_to_piece(i)

    def _literal_backend(self) -> Backend:
        with self._lazy:
            if self._literal is None:
                literal = Backend.from_str(self._backend.to_str())
                literal.encode_special_tokens = True
                self._literal = literal
        return self._literal

    def _special_finder(self) -> Backend:
        """A backend that only finds special tokens: each match gets id >= 1, and each run of
        other text one id-0 token, with character offsets (the matching is the library's own
        automaton, so this is linear in the text for any number of special tokens)."""
        with self._lazy:
            if self._specials is None:
                finder = Backend(WordLevel({"[text]": 0}, unk_token="[text]"))
                added = self._backend.get_added_tokens_decoder()
                specials = [
                    AddedToken(
                        t.content,
                        special=True,
                        normalized=t.normalized,
                        single_word=t.single_word,
                        lstrip=t.lstrip,
                        rstrip=t.rstrip,
                    )
                    for i, t in sorted(added.items())
                    if i in self._special_ids
                ]
                finder.add_special_tokens(specials)
                finder.add_special_tokens([AddedToken(p, normalized=False) for p in PLACEHOLDERS])
                if any(t.normalized for t in specials):  # matched after normalizing
                    finder.normalizer = self._backend.normalizer
                self._finder_ids = {
                    finder.token_to_id(t.content): self._backend.token_to_id(t.content)
                    for t in specials
                }
                self._specials = finder
        return self._specials


def _encode(backend: Backend, text: str) -> Any:
    """backend.encode(text) without special tokens, through `encode_batch`: the library's
    `encode` holds the GIL for the whole tokenization (half a second for 500 KB, during
    which a server's event loop cannot run); `encode_batch` releases it. Same ids, same cost."""
    return backend.encode_batch([text], add_special_tokens=False)[0]


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


_NOT_IN_UTF8 = {0xC0, 0xC1, *range(0xF5, 0x100)}  # bytes no UTF-8 text contains


def _bytes_per_token_bound(
    backend: Backend, pieces: list[str], decoding: _ByteDecoding | None
) -> tuple[int | None, str]:
    """(An upper bound on the text bytes one token stands for, or None when none holds;
    the ASCII characters the vocabulary has no byte for, which encoding drops).

    A bound needs every byte of the input to end up in some token (byte-level BPE, or BPE
    with byte fallback, with every byte UTF-8 can hold; a missing ASCII control byte is
    tolerated and counted out), nothing that deletes text (stripping normalizers,
    whitespace-splitting pre-tokenizers, added tokens that swallow spaces), and nothing that
    merges unknown text into one token."""
    if decoding is None or type(backend.model).__name__ != "BPE":
        return None, ""
    if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
        return None, ""
    vocab = set(pieces)
    if getattr(backend.model, "byte_fallback", False):
        missing = {b for b in range(256) if f"<0x{b:02X}>" not in vocab}
    else:
        missing = {b for b, ch in _bytes_to_unicode().items() if ch not in vocab}
    missing -= _NOT_IN_UTF8
    if any(0x80 <= b < 0xC2 for b in missing):
        return None, ""  # a continuation byte: whole characters could vanish
    # A missing lead byte (SmolLM2 lacks 0xF1 and 0xF2) drops one byte of a multi-byte
    # character, which keeps at least half of its bytes.
    lead_shrink = 2 if any(b >= 0xC2 for b in missing) else 1
    shrink = _normalizer_shrink(backend)
    if shrink is None or not _pre_tokenizer_keeps_text(backend):
        return None, ""
    longest = max((len(b) for b in decoding.token_bytes), default=1)
    dropped = "".join(chr(b) for b in sorted(missing) if b < 0x80)
    return max(1, longest) * shrink * lead_shrink, dropped


def _components(obj: Any) -> list[dict[str, Any]]:
    if obj is None:
        return []
    spec = json.loads(obj.__getstate__())
    return spec.get("normalizers") or spec.get("pretokenizers") or [spec]


def _normalizer_shrink(backend: Backend) -> int | None:
    """How many times fewer bytes normalized text can have (None: it can delete text)."""
    shrink = 1
    for step in _components(backend.normalizer):
        kind = step["type"]
        if kind in ("NFC", "NFD", "NFKC", "NFKD", "Lowercase"):
            shrink = 4  # e.g. NFKC maps the 4-byte U+1D400 to the 1-byte "A"
        elif kind == "Prepend" or (kind == "Replace" and step.get("content")):
            continue
        else:
            return None  # Strip, StripAccents, BertNormalizer, Precompiled, Replace with ""...
    return shrink


def _pre_tokenizer_keeps_text(backend: Backend) -> bool:
    for step in _components(backend.pre_tokenizer):
        kind = step["type"]
        if kind == "Split" and step.get("behavior") != "Removed":
            continue
        if kind not in ("ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"):
            return False
    return True


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
