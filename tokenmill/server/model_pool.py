"""Several models behind one server, loaded on demand, the least recently used evicted.

    ModelPool(models, max_loaded=..., memory_budget=...)   name -> loader, loaded engines
    await pool.acquire(name) -> Slot    loads the model if it is not loaded; pins it
    pool.release(slot)                  unpins it (an idle model may be evicted)
    ModelSelect (ASGI middleware)       pins the model a request's JSON body names for the
                                        whole answer, a stream's included

`tokenmill serve --model A --model B` (or `--models-dir`) builds a pool; one `--model`
builds none, and the app runs over its one AsyncEngine exactly as before. The first model
is the default (a request without `model` gets it) and is loaded at start; the others load
when a request first names them, as llama.cpp's router mode and ollama do.

Loading: one at a time (two loads at once would need both models' memory, and compete for
the same cores), on a worker thread, so the event loop keeps answering the loaded models.
Every request for a model being loaded waits for that one load (`Slot.loading`, one future
per model); a load that fails fails them all, and the next request tries again.

Eviction: before a load, the least recently used idle model is stopped (its engine thread
ended, its LLMEngine dropped, then gc and malloc_trim give the memory back) until the new
one fits `max_loaded` and `memory_budget`. A model's size is its weights plus its KV pool
as its engine holds them (`engine_bytes`), measured when it loads; before its first load
it is estimated from its files' size, and checked again once it is in. A model with a
request running or queued (`Slot.users`, counted by ModelSelect from the request's start to
its answer's last byte) is never evicted: a load that finds no room waits for one of
them to finish, up to `wait_timeout_s`, then answers 503 with Retry-After.

The pool runs on the event loop (every field is read and written there); only the load and
the stop of an engine run on worker threads.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.heap import give_back_memory
from tokenmill.server.asgi import HTTPMiddleware, replay_body
from tokenmill.server.async_engine import AsyncEngine, ShuttingDown
from tokenmill.server.errors import APIError, invalid
from tokenmill.server.json_body import parse_body
from tokenmill.tokenizer.reasoning import resolve as resolve_reasoning
from tokenmill.units import format_bytes

if TYPE_CHECKING:
    from tokenmill.engine.llm_engine import LLMEngine

log = logging.getLogger("tokenmill.server")

WAIT_TIMEOUT_S = 60.0  # how long a load waits for a busy model to become evictable
RETRY_AFTER = {"Retry-After": "5"}


@dataclass(frozen=True)
class ServedModel:
    """One model the server may serve: its names and how to load it.

    name: what responses and /v1/models call it; aliases: other names clients may send.
    load: builds the model's AsyncEngine, not started (blocking: runs on a worker thread).
    path: its checkpoint, whose size is the first estimate of its memory (None: 0).
    reasoning_parser: serve's --reasoning-parser, resolved against its chat template."""

    name: str
    load: Callable[[], AsyncEngine]
    aliases: tuple[str, ...] = ()
    path: Path | None = None
    reasoning_parser: str = "auto"


@dataclass(eq=False)
class Slot:
    """A served model's place in the pool: loaded (engine) or not, and who uses it."""

    model: ServedModel
    engine: AsyncEngine | None = None
    reasoning: str | None = None  # the reasoning format its chat answers split by
    loading: asyncio.Future | None = None  # the one load in progress
    users: int = 0  # requests running or queued on it (or waiting for its load)
    last_used: float = 0.0  # time.monotonic() of its last request's start or end
    nbytes: int | None = None  # weights + KV pool, measured at its last load
    max_model_len: int | None = None  # known once it has loaded
    loads: int = 0
    evictions: int = 0

    @property
    def name(self) -> str:
        return self.model.name


def engine_bytes(engine: LLMEngine) -> int:
    """The memory a loaded model holds: its weights (each tensor storage of the model's
    state dict once, tied ones and views shared) plus its KV pool."""
    seen: dict[int, int] = {}
    for tensor in engine.model.state_dict().values():
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) + engine.cache.nbytes


def files_bytes(path: Path | None) -> int:
    """Bytes of a checkpoint on disk: a .gguf file, or a folder's files."""
    if path is None or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class ModelPool:
    """The models a server serves, by name; the first is the default.

    max_loaded: most models loaded at once (None: no limit). memory_budget: most bytes of
    weights + KV pools loaded at once (None: no limit). wait_timeout_s: how long a load
    waits for room while every loaded model has requests, before a 503."""

    def __init__(
        self,
        models: Sequence[ServedModel],
        *,
        max_loaded: int | None = None,
        memory_budget: int | None = None,
        wait_timeout_s: float = WAIT_TIMEOUT_S,
    ):
        if not models:
            raise ValueError("a model pool needs at least one model")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be at least 1, got {max_loaded}")
        self.slots = {m.name: Slot(m) for m in models}
        self.default = models[0].name
        self._names: dict[str, str] = {}  # every name and alias -> the model's name
        for m in models:
            for n in (m.name, *m.aliases):
                owner = self._names.setdefault(n, m.name)
                if owner != m.name:
                    raise ValueError(f"the name {n!r} is given to both {owner!r} and {m.name!r}")
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget
        self.wait_timeout_s = wait_timeout_s
        self.draining = False
        self._load_lock: asyncio.Lock | None = None  # made on the loop (see _lock)
        self._changed: asyncio.Event | None = None  # set when a model is released or evicted
        self._started = False

    # ---- names ----
    def resolve(self, name: str | None) -> str | None:
        """The served model's name for a name a client sent (None: the default), or None
        when no served model has that name."""
        return self.default if name is None else self._names.get(name)

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def loaded(self) -> list[Slot]:
        return [s for s in self.slots.values() if s.engine is not None]

    # ---- lifecycle (the app's lifespan) ----
    def add_loaded(self, name: str, engine: AsyncEngine) -> None:
        """Hand the pool a model already loaded (serve loads the default before it binds
        the port's listener); it starts with the pool."""
        slot = self.slots[name]
        self._installed(slot, engine)
        if self._started:
            engine.start()

    def start(self) -> None:
        self._started = True
        for slot in self.loaded():
            slot.engine.start()

    def stop(self) -> None:
        for slot in self.loaded():
            slot.engine.stop()

    def drain(self) -> None:
        """SIGTERM: take no new requests and load nothing more; running ones carry on."""
        self.draining = True
        for slot in self.loaded():
            slot.engine.drain()

    def health(self) -> tuple[bool, str]:
        """(True, "ok") when every loaded model's engine is; else the first failure,
        naming its model. No model loaded is healthy: one loads on the next request."""
        for slot in self.loaded():
            ok, reason = slot.engine.health()
            if not ok:
                return False, f"model {slot.name!r}: {reason}"
        return True, "ok"

    # ---- acquiring a model for a request ----
    async def acquire(self, name: str) -> Slot:
        """The slot of served model `name`, loaded, pinned for the caller until
        release(slot). Loads it (evicting idle models) if it is not loaded; raises APIError
        (503) when it cannot, or ShuttingDown when the server drains."""
        slot = self.slots[name]
        slot.users += 1
        try:
            while slot.engine is None:
                if self.draining:
                    raise ShuttingDown("the server is shutting down; retry on another instance")
                if slot.loading is None:
                    slot.loading = asyncio.ensure_future(self._load(slot))
                # shielded: a client that leaves does not cancel the load the others wait for
                await asyncio.shield(slot.loading)
        except BaseException:
            self.release(slot)
            raise
        slot.last_used = time.monotonic()
        return slot

    def release(self, slot: Slot) -> None:
        slot.users -= 1
        slot.last_used = time.monotonic()
        self._notify()

    # ---- loading and eviction (on the loop; the heavy parts on worker threads) ----
    async def _load(self, slot: Slot) -> None:
        try:
            async with self._lock():
                if slot.engine is not None:
                    return
                estimate = slot.nbytes if slot.nbytes is not None else files_bytes(slot.model.path)
                await self._make_room(slot, estimate, wait=True)
                log.info("loading model %s", slot.name)
                started = time.perf_counter()
                loop = asyncio.get_running_loop()
                try:
                    engine = await loop.run_in_executor(None, self._load_engine, slot.model)
                except Exception as e:
                    log.exception("loading model %s failed", slot.name)
                    raise APIError(
                        500,
                        f"the model {slot.name!r} could not be loaded: {e}",
                        type="server_error",
                        code="model_load_failed",
                    ) from None
                self._installed(slot, engine)
                log.info(
                    "loaded model %s in %.1f s (%s of weights and KV pool)",
                    slot.name,
                    time.perf_counter() - started,
                    format_bytes(slot.nbytes or 0),
                )
                if self.memory_budget is not None and slot.nbytes > self.memory_budget:
                    await self._evict(slot)
                    raise self._too_big(slot, slot.nbytes)
                await self._make_room(slot, slot.nbytes, wait=False)  # the estimate was low
        finally:
            slot.loading = None

    def _load_engine(self, model: ServedModel) -> AsyncEngine:
        """Build and start a model's engine (a worker thread: loading takes seconds, and
        start() may touch every page of the KV pool)."""
        engine = model.load()
        engine.start()
        return engine

    def _installed(self, slot: Slot, engine: AsyncEngine) -> None:
        slot.engine = engine
        slot.nbytes = engine_bytes(engine.engine)
        slot.max_model_len = engine.engine.max_model_len
        slot.reasoning = resolve_reasoning(
            slot.model.reasoning_parser, engine.engine.tokenizer.chat_template
        )
        slot.loads += 1
        slot.last_used = time.monotonic()

    def _over(self, slot: Slot, need: int) -> bool:
        """Would loading `slot` (need bytes) beside the other loaded models pass a limit?"""
        others = [s for s in self.loaded() if s is not slot]
        if self.max_loaded is not None and len(others) + 1 > self.max_loaded:
            return True
        used = sum(s.nbytes or 0 for s in others)
        return self.memory_budget is not None and used + need > self.memory_budget

    async def _make_room(self, slot: Slot, need: int, *, wait: bool) -> None:
        """Evict idle models, least recently used first, until `slot` fits. wait: while
        only busy models are left, wait for one to finish (then 503); else leave it over."""
        if self.memory_budget is not None and need > self.memory_budget:
            raise self._too_big(slot, need)
        deadline = time.monotonic() + self.wait_timeout_s
        while self._over(slot, need):
            idle = [s for s in self.loaded() if s is not slot and s.users == 0]
            if idle:
                await self._evict(min(idle, key=lambda s: s.last_used))
                continue
            if not wait:
                log.warning(
                    "model %s is loaded over the limits: every other one is busy", slot.name
                )
                return
            left = deadline - time.monotonic()
            if left <= 0 or self.draining:
                busy = ", ".join(repr(s.name) for s in self.loaded() if s is not slot)
                raise APIError(
                    503,
                    f"the model {slot.name!r} cannot be loaded now: the loaded models "
                    f"({busy}) all have requests running, and {self._limits()} leaves no "
                    "room beside them; retry later",
                    type="server_error",
                    code="model_unavailable",
                    headers=RETRY_AFTER,
                )
            changed = self._event()
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                pass

    async def _evict(self, slot: Slot) -> None:
        """Stop a model's engine and give its memory back. It is gone from the pool at
        once (a request for it from now on loads it again, after this load)."""
        engine, slot.engine = slot.engine, None
        slot.evictions += 1
        log.info("evicting model %s (%s)", slot.name, format_bytes(slot.nbytes or 0))
        await asyncio.get_running_loop().run_in_executor(None, _close, engine)
        self._notify()

    def _too_big(self, slot: Slot, need: int) -> APIError:
        return APIError(
            503,
            f"the model {slot.name!r} needs {format_bytes(need)} (weights and KV pool), more "
            f"than the whole memory budget of {format_bytes(self.memory_budget or 0)} "
            "(--models-memory)",
            type="server_error",
            code="model_too_large",
        )

    def _limits(self) -> str:
        parts = []
        if self.max_loaded is not None:
            parts.append(f"--max-loaded-models {self.max_loaded}")
        if self.memory_budget is not None:
            parts.append(f"--models-memory {format_bytes(self.memory_budget)}")
        return " and ".join(parts)

    def _lock(self) -> asyncio.Lock:
        if self._load_lock is None:
            self._load_lock = asyncio.Lock()
        return self._load_lock

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        if self._changed is not None:  # wake every waiter; later ones wait on a new event
            self._changed.set()
            self._changed = None


def _close(engine: AsyncEngine) -> None:
    """Stop an evicted engine's thread and release what it held (a worker thread)."""
    engine.stop()
    engine.engine.close()
    del engine
    gc.collect()  # the model's modules hold reference cycles; free their tensors now
    give_back_memory()


# --------------------------------------------------------------------------- the middleware


@dataclass
class _Choice:
    """What ModelSelect decided for a request, kept in request.state.model_choice."""

    slot: Slot | None = None  # the model pinned for it
    error: APIError | None = field(default=None)  # why none is (raised by the route)


class ModelSelect(HTTPMiddleware):
    """ASGI middleware (inside BodyLimit, so the body is in memory): for a POST to an API
    route, read the JSON body's `model`, acquire that model (loading it if needed) and keep
    it pinned until the answer's last byte is sent. The route reads the choice through
    running.engine_of / check_model; an unknown name or a model that cannot load is
    raised there, so the error comes out in the route's API shape.

    authorized(scope): whether the request carries a valid API key (a client without one
    must not make the server load or evict anything; the route answers its 401)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        pool: ModelPool,
        paths: Callable[[], set[str]],
        authorized: Callable[[Scope], bool],
    ):
        super().__init__(app)
        self.pool = pool
        self.paths = paths
        self.authorized = authorized

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["method"] != "POST"
            or scope["path"] not in self.paths()
            or not self.authorized(scope)
        ):
            await self.app(scope, receive, send)
            return
        message = await receive()  # BodyLimit's replay: the whole body in one message
        body = message.get("body", b"")
        choice = _Choice()
        scope.setdefault("state", {})["model_choice"] = choice
        name = await self._named(scope, body)
        if name is not _UNREADABLE:
            served = self.pool.resolve(name) if name is None or isinstance(name, str) else None
            if served is None:
                choice.error = unknown_model(self.pool, name)
            else:
                try:
                    choice.slot = await self.pool.acquire(served)
                except (APIError, ShuttingDown) as e:
                    choice.error = (
                        e
                        if isinstance(e, APIError)
                        else APIError(503, str(e), type="server_error", code="shutting_down",
                                      headers={"Retry-After": "1"})
                    )  # fmt: skip
        try:
            await self.app(scope, replay_body(body, receive), send)
        finally:
            if choice.slot is not None:
                self.pool.release(choice.slot)

    async def _named(self, scope: Scope, body: bytes) -> object:
        """The body's `model` (None when it has none), or _UNREADABLE when it is no JSON
        object (the route, reading it with the same parse_body, answers that)."""
        try:
            parsed = await parse_body(scope, body)
        except APIError:
            return _UNREADABLE
        return parsed.get("model")


_UNREADABLE = object()


def unknown_model(pool: ModelPool, name: object) -> APIError:
    """The 404 for a name no served model has (or a 400 for a `model` that is no string)."""
    if not isinstance(name, str):
        return invalid("model must be a string naming one of the served models", "model")
    served = ", ".join(f"'{n}'" for n in pool.names)
    shown = name if len(name) <= 100 else name[:97] + "..."
    return APIError(
        404,
        f"The model '{shown}' does not exist; this server serves {served}",
        param="model",
        code="model_not_found",
    )
