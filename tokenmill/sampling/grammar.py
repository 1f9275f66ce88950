"""Constrained decoding: the output must match a JSON Schema, a regex, a choice or a grammar.

The matching engine is llguidance (Rust, CPU; vLLM and llama.cpp use it too):

    GrammarCompiler.compile(kind, value)   once per request, off the engine thread;
        -> CompiledGrammar                 cached by source, so a repeated schema is free
    CompiledGrammar.matcher()              one GrammarMatcher per sequence (a cheap copy)
    allowed_tokens(matchers)               each step: the [R, V] mask of the constrained
                                           rows, one bitmask filled by llguidance's threads
    apply_token_mask(logits, rows, allowed)  the sampler stage: -inf where not allowed
    GrammarMatcher.consume(token)          as the engine accepts each token

The mask is a sampler stage right after penalties and logit_bias, so temperature,
top-k/top-p/min-p and the argmax only ever see allowed tokens. Rows without a
constraint are never touched, and a batch without one never imports this module's
work at all.

A matcher's state is exactly the output it consumed, and a sequence keeps its
output through preemption (recomputation only rebuilds KV) and prefix caching
(which covers prompt KV only), so both work with no special handling: the
matcher simply stays where it was.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch
from torch import Tensor

from tokenmill.heap import give_back_memory

log = logging.getLogger("tokenmill.grammar")

# JSON Schema output layout. llguidance's default lets whitespace run anywhere, and a
# small model then pads with newlines until max_tokens. One fixed layout, json.dumps'
# own (", " and ": "), keeps it on the values. A schema can still ask for another with
# its "x-guidance" key (llguidance applies defaults, then the schema's, then overrides).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 64  # compiled grammars kept per model, at most
# ... and at most this many bytes of them: a 20,000-entry guided_choice is ~50 MiB
# compiled, and 64 of them took RSS from 1 to 4.3 GB. A typical JSON
# schema compiles to well under 1 MiB, so this still keeps hundreds of them.
CACHE_BYTES = 64 * 2**20
CACHE_IDLE_S = 600.0  # an entry unused this long is dropped at the next compile
# The size of a compiled grammar is not reported by llguidance: it is estimated as the
# process's RSS growth across the compile, and at least this many bytes per character of
# its source (measured: 45-80 for guided_choice lists of 2,000-20,000 entries).
BYTES_PER_SOURCE_CHAR = 64
# From this many rows on, masks are filled by llguidance's thread pool; below it, one
# after another on the engine thread. Handing 4 rows to the pool took 1.9-2.1 ms a step
# on 2 busy cores (its thread competes with torch's), filling them in turn 0.75 ms
# (benchmarks/structured.py).
PARALLEL_MIN_ROWS = 16
_LIMITS = {"verbose_errors": False}  # no parser dumps in error messages
# Depth limits checked before llguidance sees a constraint: its compiler recurses once per
# level, and a chain of ~1,000 schemas through $ref or ~3,000 grammar rules overflows the
# native stack (SIGSEGV: the whole server). Inline nesting it catches itself.
# objects nested along any path, $ref targets included, counted per JSON object (a
# property is 3: the schema, its "properties", the property's schema): ~100 levels of
# nested objects, where 500 chained through $ref compiled and 1,000 crashed
MAX_SCHEMA_DEPTH = 300
# Properties in one schema, all objects together. llguidance's compile time grows faster
# than the count (Zen 5, one core: 5,000 pattern properties 1.5 s, 8,000 5.5 s) and past
# ~10,000 it panics on its u16 symbol table after seconds of work; no hand-written
# schema comes near this.
MAX_SCHEMA_PROPERTIES = 4096
MAX_RULE_DEPTH = 500  # grammar rules along any chain of references


class GrammarError(ValueError):
    """A schema, regex, choice or grammar that cannot be compiled; one line, naming why."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class GrammarLimitError(GrammarError):
    """A compiled constraint that llguidance could not follow past some token (one of its
    parser limits, e.g. 2,000 Earley items in a row): that request fails, alone."""


# --------------------------------------------------------------------------- sources


def grammar_source(kind: str, value: Any) -> str:
    """llguidance's grammar text for one constraint (not yet checked against anything).

    kind: "json_schema" (a dict or bool), "regex", "choice" (a list of strings) or
    "grammar" (Lark, llguidance's dialect, or llama.cpp's GBNF)."""
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {} if value is True else value, defaults=JSON_LAYOUT
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        # One regex alternation: a single lexeme, which llguidance's lazy lexer walks as a
        # trie. As Lark alternatives ("a" | "b" | ...) every choice was an Earley item, and
        # past 2,000 of them sharing a first token the parser failed at the first token
        # ("Current row has 2001 items; max is 2000"); a 20,000-entry list also
        # compiled 6x slower.
        return llguidance.LLMatcher.grammar_from_regex("|".join(map(_regex_literal, value)))
    if kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", value)  # GBNF is converted to Lark
        except ValueError as e:
            message = _panic_message(kind, str(e)) or f"invalid grammar: {_one_line(str(e))}"
            raise GrammarError(kind, message) from None
    raise ValueError(f"unknown constraint kind {kind!r}")


_REGEX_META = frozenset('\\.+*?()|[]{}^$#&-~/"')


def _regex_literal(text: str) -> str:
    """`text` as a regex that matches exactly it (Rust regex syntax: any ASCII
    punctuation may be escaped; everything else stands for itself)."""
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


def _one_line(message: str) -> str:
    """llguidance's messages can span lines (a caret under the source); keep the words."""
    kept = []
    for line in message.splitlines():
        line = line.strip()
        if line.startswith(("<state>", "<grammar>")):
            break
        line = line.replace("<non-verbose/>", "").strip()
        if line and not set(line) <= {"^", " "} and not re.match(r"\d+ \|", line):
            kept.append(line)
    return " ".join(kept)


# llguidance reports a panic of its Rust code as an error text: "panic: <assertion>", a
# backtrace and the build's source paths (a 3.4 KB 400 for a schema of 15,000 patterns).
# The client gets one line naming the problem; the log keeps the rest.
_PANIC = re.compile(r"\bpanic(?:ked at\b|:)")
MAX_SYMBOLS = 65_535  # llguidance's grammar symbols are u16 indices


def _panic_message(kind: str, error: str) -> str | None:
    """The client's message for an llguidance panic, or None when `error` is no panic."""
    if _PANIC.search(error) is None:
        return None
    log.warning("llguidance panicked compiling a %s: %s", kind, error.split("<backtrace>")[0])
    if "symbols.len()" in error or "u16::MAX" in error:
        return (
            f"{kind} is too large to compile: it needs more than the grammar engine's "
            f"{MAX_SYMBOLS:,} symbols; make it smaller"
        )
    return f"{kind} could not be compiled: the grammar engine failed on it; simplify it"


def _message(kind: str, error: str) -> str:
    panic = _panic_message(kind, error)
    if panic is not None:
        return panic
    error = _one_line(error)
    unsupported = re.match(r"Unimplemented keys: \[(.*)\]", error)
    if unsupported:
        keys = unsupported[1].replace('"', "")
        return f"json_schema uses keywords the grammar engine does not support: {keys}"
    if kind != "grammar":  # positions refer to the Lark text made from it, not the user's
        error = re.sub(r"^at \d+\(\d+\): ", "", error).split("(in regex): ", 1)[-1]
    return f"invalid {kind}: {error}"


# --------------------------------------------------------------------------- bounds


def _pointer(root: Any, ref: str) -> Any:
    """The value a local JSON pointer ("#/$defs/a") names in root, or None."""
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def schema_depth(schema: Any, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """How many JSON objects nest along the deepest path of `schema`, following local $refs
    (a recursive $ref counts once: a cycle is a grammar rule, not depth). Stops counting
    past `limit` (returns limit + 1), so its own recursion stays bounded."""
    ref_depth: dict[str, int] = {}  # finished $ref targets
    active: set[str] = set()  # $ref targets on the current path (cycles)

    def depth(node: Any, level: int) -> int:
        if level > limit:
            return level
        if isinstance(node, list):
            return max((depth(v, level) for v in node), default=level - 1)
        if not isinstance(node, dict):
            return level - 1
        deepest = level
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and ref not in active:
            if ref not in ref_depth:  # its depth below this level, counted from here on
                active.add(ref)
                target = _pointer(schema, ref)
                below = depth(target, level + 1) - level if target is not None else 0
                active.discard(ref)
                if level + below > limit:  # stop: the answer is "too deep" already
                    return level + below
                ref_depth[ref] = below
            deepest = max(deepest, level + ref_depth[ref])
        for key, value in node.items():
            if key != "$ref" and isinstance(value, (dict, list)):
                deepest = max(deepest, depth(value, level + 1))
            if deepest > limit:
                break
        return deepest

    return min(depth(schema, 1), limit + 1)


_RULE = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?\s*:(?!:)", re.M)
_LITERAL = re.compile(r'"(?:\\.|[^"\\])*"|/(?:\\.|[^/\\\n])+/[a-z]*')
_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def rule_depth(lark: str, limit: int = MAX_RULE_DEPTH) -> int:
    """The longest chain of rule references in a Lark grammar (llguidance's text, GBNF
    already converted), cycles not counted; linear in the text, no recursion."""
    heads = list(_RULE.finditer(lark))
    refs: dict[str, set[str]] = {}
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(lark)
        body = _LITERAL.sub(" ", lark[head.end() : end])
        refs.setdefault(head[1], set()).update(_NAME.findall(body))
    done: dict[str, int] = {}
    for start in refs:
        if start in done:
            continue
        stack, on_path = [(start, iter(refs[start]))], {start}
        while stack:  # iterative depth-first search: depth = 1 + deepest reference
            name, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.discard(name)
                kids = (done.get(c, 0) for c in refs[name] if c in refs and c not in on_path)
                done[name] = min(1 + max(kids, default=0), limit + 1)
            elif child in refs and child not in done and child not in on_path:
                stack.append((child, iter(refs[child])))
                on_path.add(child)
    return max(done.values(), default=0)


def schema_properties(schema: Any) -> int:
    """How many properties the objects of `schema` declare, all together (iterative)."""
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                count += len(props)
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return count


def _check_schema(kind: str, schema: Any, what: str) -> None:
    if schema_depth(schema) > MAX_SCHEMA_DEPTH:
        raise GrammarError(
            kind,
            f"{what} nests more than {MAX_SCHEMA_DEPTH} levels deep "
            "(counting $ref targets); flatten it",
        )
    n = schema_properties(schema)
    if n > MAX_SCHEMA_PROPERTIES:
        raise GrammarError(
            kind,
            f"{what} declares {n:,} properties, more than the {MAX_SCHEMA_PROPERTIES:,} "
            "that compile in bounded time; make it smaller",
        )


def check_bounds(kind: str, value: Any, source: str) -> None:
    """Raise GrammarError for a constraint deep enough to overflow llguidance's stack, or
    large enough to take seconds of CPU before failing anyway."""
    if kind == "json_schema":
        _check_schema(kind, value, "json_schema")
    if kind != "grammar":
        return
    if rule_depth(source) > MAX_RULE_DEPTH:
        raise GrammarError(
            kind, f"grammar chains more than {MAX_RULE_DEPTH} rules deep; flatten it"
        )
    decoder = json.JSONDecoder()
    for embedded in re.finditer(r"%json\s*", source):  # schemas inside (tool calls)
        try:
            schema, _ = decoder.raw_decode(source, embedded.end())
        except ValueError:
            continue  # not JSON: llguidance reports it
        _check_schema(kind, schema, "a JSON schema in the grammar")


# --------------------------------------------------------------------------- matching


class GrammarMatcher:
    """One sequence's position in its grammar. `allowed()` is computed once per position."""

    def __init__(self, kind: str, matcher: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self.kind = kind
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._matcher = matcher  # llguidance.LLMatcher
        self._allowed: Tensor | None = None  # [V] bool, for the current position
        self._consumed = 0  # tokens consumed so far
        self._dead_end = False  # no token could continue the text: EOS was allowed instead

    def allowed(self) -> Tensor:
        """[V] bool: the tokens the grammar allows next."""
        return allowed_tokens([self])[0]

    def consume(self, token_id: int) -> None:
        """Advance past a sampled token (always an allowed one). Raises GrammarLimitError
        when llguidance fails on it: the request fails with a one-line 400 rather than
        end early with a truncated text and a 200 (the matcher would allow only EOS)."""
        self._allowed = None
        if not self._matcher.consume_token(token_id):
            error = _one_line(self._matcher.get_error())
            if self._dead_end or "doesn't satisfy the grammar" in error:
                # A text the vocabulary cannot spell (a word vocabulary, a choice of
                # characters it lacks): the sequence ends at EOS, the matcher allowing
                # only that from here, as any answer that cannot go on does.
                log.warning("grammar matcher: %s; ending the sequence", error)
                self._dead_end = True
                return
            raise GrammarLimitError(  # one of llguidance's limits: the request fails
                self.kind,
                f"the {self.kind} constraint failed after {self._consumed} tokens: "
                f"{error}; simplify it",
            )
        self._consumed += 1

    @property
    def finished(self) -> bool:
        """The grammar admits nothing more (it would allow only EOS)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return _one_line(self._matcher.get_error()) if self._matcher.is_error() else None


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled against one tokenizer; `matcher()` starts a sequence on it."""

    kind: str
    template: Any  # llguidance.LLMatcher at the start, never advanced
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    compile_ms: float
    nbytes: int = 0  # estimated memory of `template` (see BYTES_PER_SOURCE_CHAR)

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(
            self.kind, self.template.deep_copy(), self.vocab_size, self.eos_token_ids
        )


_executor_lock = threading.Lock()
_executor: Any = None


def _shared_executor() -> Any:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


def _rss_bytes() -> int:
    """This process's resident memory (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """llguidance's int32 bitmask [R, ceil(V/32)] (bit j of word w = token 32w + j) as
    bool [R, V].

    numpy's unpackbits, one pass in C: ~15 us for 50k tokens, where the same in torch ops
    (shift, and, view, bool) takes 5-10x longer and far more on a busy machine (torch
    splits small ops over its threads, which then wait on each other)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab_size].view(np.bool_))


def allowed_tokens(matchers: Sequence[GrammarMatcher]) -> Tensor:
    """[R, V] bool: the next tokens each matcher allows. Masks not yet known for the
    current positions are filled into one bitmask (by a thread pool for many rows)."""
    todo = [m for m in matchers if m._allowed is None]
    if todo:
        vocab = todo[0].vocab_size
        words = (vocab + 31) // 32
        bitmask = torch.zeros((len(todo), words), dtype=torch.int32)
        if len(todo) < PARALLEL_MIN_ROWS:
            for i, m in enumerate(todo):
                m._matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
        else:
            _shared_executor().unsafe_compute_mask_ptr(
                [(m._matcher, i) for i, m in enumerate(todo)],
                bitmask.data_ptr(),
                words * 4,
                len(todo),
            )
        allowed = unpack_bitmask(bitmask, vocab)
        empty = ~bitmask.numpy().any(axis=-1)  # numpy: see unpack_bitmask
        for m, row, none in zip(todo, allowed, empty, strict=True):
            if none:
                # No token can continue the text (a vocabulary that cannot spell what the
                # grammar needs): end the sequence rather than let argmax pick token 0.
                log.warning("grammar allows no token here; ending the sequence")
                row[m.eos_token_ids] = True
                m._dead_end = True
            m._allowed = row
        if len(todo) == len(matchers):  # the usual step: every row moved on
            return allowed
    return torch.stack([m._allowed for m in matchers])


def apply_token_mask(logits: Tensor, rows: Tensor, allowed: Tensor) -> Tensor:
    """The constraint stage: logits[rows[i], t] = -inf where allowed[i, t] is False.

    logits: [B, V]; rows: [R] long; allowed: [R, V] bool. Returns new logits; rows not
    listed are left as they are."""
    masked = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))
    return logits.index_copy(0, rows, masked)


# --------------------------------------------------------------------------- compiling


class _EncodeForLLG:
    """The tokenizer as llguidance's TokenizerWrapper wants it: the token table, the
    special ids, and text -> ids (str only: raising on bytes tells the wrapper so)."""

    def __init__(self, tokenizer: Any, tokens: list[bytes], eos_token_id: int):
        self._tokenizer = tokenizer
        self.tokens = tokens
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_ids)

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")
        return self._tokenizer.encode(text, add_special_tokens=False, parse_special=False)


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; thread-safe, with an LRU cache.

    vocab_size: the width of the model's logits (may exceed the tokenizer's table).
    eos_token_ids: the tokens that end a sequence; the grammar allows them once it is
    complete."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_bytes: int = CACHE_BYTES,
        cache_idle_s: float = CACHE_IDLE_S,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.cache_bytes = cache_bytes
        self.cache_idle_s = cache_idle_s
        self._lock = threading.Lock()
        self._lltokenizer: Any = None
        # key -> (grammar, last use on time.monotonic()), least recently used first
        self._cache: OrderedDict[tuple, tuple[CompiledGrammar, float]] = OrderedDict()
        self._cached_bytes = 0

    @property
    def cached_bytes(self) -> int:
        """The estimated memory of the grammars in the cache."""
        return self._cached_bytes

    def lltokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built on first use (~0.5 s for 50k
        tokens, a few seconds for 250k) and kept."""
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = self._build_lltokenizer()
            return self._lltokenizer

    def _build_lltokenizer(self) -> Any:
        table = self.tokenizer.token_bytes()[: self.vocab_size]
        table += [b""] * (self.vocab_size - len(table))  # ids the tokenizer never produces
        for i in self.tokenizer.special_ids:
            if i < self.vocab_size:
                # llguidance's marker for special tokens: text never matches them, and a
                # grammar names them as <|name|> or <[id]>.
                table[i] = b"\xff" + table[i]
        if not self.eos_token_ids:
            raise GrammarError("grammar", "the model has no EOS token to end constrained output")
        wrapper = llguidance.TokenizerWrapper(
            _EncodeForLLG(self.tokenizer, table, self.eos_token_ids[0])
        )
        return llguidance.LLTokenizer(
            wrapper, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
        )

    def compile(self, kind: str, value: Any) -> CompiledGrammar:
        """Compile (or fetch from the cache) one constraint. Raises GrammarError."""
        key = (kind, json.dumps(value, sort_keys=True, ensure_ascii=False))
        try:
            key[1].encode()
        except UnicodeEncodeError:  # "\ud800" is valid JSON, but not text llguidance takes
            raise GrammarError(kind, f"{kind} contains a lone UTF-16 surrogate") from None
        with self._lock:
            if key in self._cache:
                compiled, _ = self._cache[key]
                self._cache[key] = (compiled, time.monotonic())
                self._cache.move_to_end(key)
                return compiled
        lltokenizer = self.lltokenizer()
        t0 = time.perf_counter()
        try:
            source = grammar_source(kind, value)
        except GrammarError:
            raise
        except (ValueError, TypeError) as e:  # e.g. a schema that is not an object
            raise GrammarError(kind, _message(kind, str(e))) from None
        check_bounds(kind, value, source)
        limits = llguidance.LLParserLimits(**_LIMITS)
        rss = _rss_bytes()
        # Builds the lexer and parser tables with the GIL released.
        matcher = llguidance.LLMatcher(lltokenizer, source, log_level=0, limits=limits)
        nbytes = max(_rss_bytes() - rss, BYTES_PER_SOURCE_CHAR * len(source))
        if matcher.is_error():
            raise GrammarError(kind, _message(kind, matcher.get_error()))
        compiled = CompiledGrammar(
            kind,
            matcher,
            self.vocab_size,
            tuple(self.eos_token_ids),
            (time.perf_counter() - t0) * 1000,
            nbytes,
        )
        self._keep(key, compiled)
        return compiled

    def _keep(self, key: tuple, compiled: CompiledGrammar) -> None:
        """Cache `compiled`, then drop entries idle past cache_idle_s and least recently
        used ones until the cache holds at most CACHE_SIZE entries and cache_bytes. One
        grammar larger than the whole budget is used, not kept."""
        now, dropped = time.monotonic(), 0
        with self._lock:
            if key not in self._cache and compiled.nbytes <= self.cache_bytes:
                self._cache[key] = (compiled, now)
                self._cached_bytes += compiled.nbytes
            while self._cache:
                oldest, (grammar, used) = next(iter(self._cache.items()))
                over = len(self._cache) > CACHE_SIZE or self._cached_bytes > self.cache_bytes
                if not over and now - used <= self.cache_idle_s:
                    break
                del self._cache[oldest]
                self._cached_bytes -= grammar.nbytes
                dropped += grammar.nbytes
        if dropped >= 8 * 2**20:  # worth a trim (a few ms)
            give_back_memory()
