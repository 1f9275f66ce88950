"""One engine loop thread, many asyncio requests.

LLMEngine is not thread-safe and batches best when one loop steps every request
together, so a single background thread owns it:

    HTTP handlers (event loop)            engine thread
    generate() -- _Add / _Abort --> commands (queue.SimpleQueue)
                                          apply commands, then engine.step()
    RequestStream <- call_soon_threadsafe - RequestOutputs, routed by request id

The thread blocks on the command queue while the engine has no work (no busy
spin) and otherwise drains it without blocking between steps, so a new request
or an abort waits at most one step. Each API request gets one RequestStream: an
asyncio.Queue fed from the engine thread with `loop.call_soon_threadsafe`. Its
first item says whether the engine took the request (or why not); then come
(choice index, RequestOutput) pairs until every one of its engine requests has
finished. A request with P prompts and n completions each runs P x n engine
requests ("<id>-<i>" for choice i = p * n + j, completion_index=j, OpenAI's order)
that are aborted together.

`drain()` (the server's SIGTERM) stops admitting: later requests raise ShuttingDown
(HTTP 503), while the requests already in the engine run to their end.

A request whose own sampling, grammar or trace fails in a step fails alone
(LLMEngine reports it in its RequestOutput.error; the API request gets a 500 and its
other choices are aborted). An exception in the step itself (the forward pass) fails
the requests of that step's batch (every request in the engine, as a step batches
them all) with a 500 and frees their blocks; the loop itself keeps going.

`health()` (GET /health) tells the truth without waiting on the engine: the loop
notes the time each time it comes round (`_beat`, after every step) and whether it is
idle (blocked on an empty command queue: nothing pending). Busy with no round
completed for `stall_timeout` seconds is a stall; a parallel run's ranks are asked too
(distributed/runtime.py::Runtime.health: a dead rank, or one that has not finished its
part of the step in flight).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tokenmill.engine.kv_cache import can_populate
from tokenmill.engine.llm_engine import LLMEngine, RequestError, RequestOutput, TokenLogprob
from tokenmill.heap import give_back_memory, give_back_now_and_then, tune_allocator
from tokenmill.sampling import FinishReason, SamplingParams
from tokenmill.sampling.grammar import CompiledGrammar, GrammarError
from tokenmill.server.metrics import EngineStats, ServerMetrics

log = logging.getLogger("tokenmill.server")
# The engine idle this long gives freed heap back to the OS (tokenmill.heap): RSS after
# a burst then returns to where it was, rather than staying at the burst's peak.
TRIM_AFTER_IDLE_S = 1.0


class QueueFull(Exception):
    """Too many requests are waiting; the client should retry later (HTTP 429)."""


class EngineFailure(Exception):
    """The engine failed while running a request, or is not running (HTTP 500)."""


class ConstraintFailure(EngineFailure, GrammarError):
    """The request's own constraint failed while generating (llguidance hit one of its
    limits): a 400 naming the constraint, or the stream's error event."""


class ShuttingDown(Exception):
    """The server is draining for shutdown and takes no new requests (HTTP 503)."""


@dataclass
class Generation:
    """One completion, collected from its stream of RequestOutputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    reasoning: str = ""  # with SamplingParams.reasoning: the thinking (text is the answer)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (not computed)

    def add(self, out: RequestOutput) -> None:
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        self.text += out.text
        self.reasoning += out.reasoning
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.finish_reason = out.finish_reason


_ADMITTED = object()  # a stream's first item when the engine took all its requests


class RequestStream:
    """The event-loop side of one API request and its n engine requests.

    Created by AsyncEngine.generate, which awaits `admitted()`; then iterate to receive
    (choice index, RequestOutput) until all n are finished; `abort()` at any time
    (idempotent, a no-op once finished) stops the rest and frees their KV blocks."""

    def __init__(self, request_ids: list[str], send_abort: Callable[[list[str]], None]):
        self.request_ids = request_ids
        self.submitted = time.perf_counter()
        self._send_abort = send_abort
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))
        self._aborted = False
        # the request field that carried its constraint ("guided_grammar",
        # "response_format"), named by a ConstraintFailure; None: the constraint's kind
        self.constraint_param: str | None = None

    # ---- engine thread side ----
    def post(self, item: object) -> None:
        """Thread-safe: hand an item to the event loop (dropped if the loop is gone)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # loop closed: nobody is listening any more
            pass

    # ---- event loop side ----
    async def admitted(self) -> None:
        """Wait until the engine has taken the request; raise why it did not."""
        try:
            item = await self._queue.get()
        except BaseException:
            self.abort()
            raise
        if item is not _ADMITTED:
            self._unfinished.clear()
            raise item

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._unfinished.clear()
                raise item
            index, out = item
            if out.finished:
                self._unfinished.discard(index)
            yield index, out

    async def collect(self) -> list[Generation]:
        """Wait for all n completions; aborts them if cancelled."""
        generations = [Generation() for _ in self.request_ids]
        try:
            async for index, out in self:
                generations[index].add(out)
        finally:
            self.abort()
        return generations

    def abort(self) -> bool:
        """Abort whatever has not finished; True if that was anything."""
        if not self._unfinished or self._aborted:
            return False
        self._aborted = True
        self._send_abort(self.request_ids)
        return True


@dataclass
class _Add:
    stream: RequestStream
    prompts: list[list[int]]  # one per choice index: prompt p repeated n times
    params: SamplingParams
    trace: object | None
    grammar: CompiledGrammar | None = None
    cache_salt: int | None = None
    embed: bool = False  # embeddings (LLMEngine.add_request(embed=True)): prefill only
    score: bool = False  # a reranker's scores (LLMEngine.add_request(score=True)): likewise


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Live:
    """Engine-thread bookkeeping for one running engine request."""

    stream: RequestStream
    index: int
    last_token: float | None = None


class AsyncEngine:
    """The server's engine: `app.state.engine`.

    engine: the synchronous LLMEngine (tokenizer, config, max_model_len); only the
    engine thread may call its methods that change state.
    max_waiting: the most engine requests that may wait (in the scheduler's queue or
    not yet picked up by the engine thread) before `generate` raises QueueFull.
    stall_timeout: seconds pending work may go without a completed step before
    `health()` reports the engine stalled."""

    def __init__(
        self, engine: LLMEngine, *, max_waiting: int | None = None, stall_timeout: float = 30.0
    ):
        self.engine = engine
        self.max_waiting = max_waiting
        tune_allocator()  # before the server's threads open their arenas (tokenmill/heap)
        self.stall_timeout = stall_timeout
        self._beat = time.monotonic()  # the engine loop's last round (see health())
        self._idle = True  # the engine loop is blocked waiting for a command
        # build info, plus what the KV cache stores (--kv-cache-dtype: a torch dtype or q8_0)
        kv_dtype = str(engine.cache.dtype).removeprefix("torch.")
        self.metrics = ServerMetrics({**engine.info(), "kv_cache_dtype": kv_dtype})
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0  # engine requests submitted, not yet added (guarded by _lock)
        self._live: dict[str, _Live] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self.draining = False

    # ---- lifecycle ----
    def start(self) -> None:
        # The KV pool made resident (see KVCache.make_resident): beside the engine where
        # the kernel maps pages without touching their contents, else before it starts.
        if can_populate():
            threading.Thread(
                target=self.engine.cache.make_resident, name="tokenmill-kv-resident", daemon=True
            ).start()
        else:
            self.engine.cache.make_resident()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._commands.put(None)
            self._thread.join(timeout)

    def drain(self) -> None:
        """Take no new requests (ShuttingDown); those already submitted carry on."""
        self.draining = True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> tuple[bool, str]:
        """(True, "ok"), or (False, one line saying why not): the loop is not running, a
        parallel rank died or is stuck, or the loop has had pending work and completed
        no step for stall_timeout seconds. Reads a few fields, never blocks."""
        if not self.alive:
            return False, "the engine loop is not running"
        runtime = self.engine.parallel
        if runtime is not None:
            ok, reason = runtime.health(self.stall_timeout)
            if not ok:
                return False, reason
        stalled = time.monotonic() - self._beat
        # The beat is taken before the step is scheduled, so it ages a little before the
        # runtime's own step clock starts: while the step waits on a rank, only the runtime
        # speaks, so that the 503 names the rank instead of the generic line.
        waiting = runtime is not None and runtime.waiting_on_a_rank()
        if not self._idle and not waiting and stalled > self.stall_timeout:
            return (
                False,
                f"the engine loop has made no progress on pending work for {stalled:.0f} s",
            )
        return True, "ok"

    # ---- the event loop's API ----
    async def generate(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        trace: object | None = None,
        grammar: CompiledGrammar | None = None,
        cache_salt: int | None = None,
        embed: bool = False,
        score: bool = False,
        constraint_param: str | None = None,
    ) -> RequestStream:
        """Queue a request (params.n engine requests per prompt) and wait until the engine
        has taken it. embed: each prompt's pooled embedding (RequestOutput.embedding, one
        finished output each) instead of generated text; score: each prompt's relevance, as
        [score] in RequestOutput.embedding (a reranker's pair). Raises QueueFull, ShuttingDown,
        EngineFailure, or RequestError for one that could never be queued or that the engine refuses.

        cache_salt: the request's prefix-cache scope (block_manager.salt_root).

        grammar: params' constraint, compiled (LLMEngine.compile_grammar, off the engine
        thread); a constrained request must bring it, so no compilation runs on the
        engine thread. constraint_param: the request field that carried it, which a
        ConstraintFailure names."""
        if (grammar is None) != (params.constraint is None):
            raise ValueError("a constrained request must be submitted with its compiled grammar")
        if not self.alive:
            raise EngineFailure("the engine loop is not running")
        if self.draining:
            raise ShuttingDown("the server is shutting down; retry on another instance")
        count = len(prompts) * params.n
        if self.max_waiting is not None and count > self.max_waiting:
            raise RequestError(
                f"n is {params.n} for {len(prompts)} prompt(s): {count} sequences, more than "
                f"this server ever queues at once ({self.max_waiting}, --max-waiting)",
                "n",
            )
        with self._lock:
            waiting = self._pending + len(self.engine.scheduler.waiting)
            if self.max_waiting is not None and waiting + count > self.max_waiting:
                raise QueueFull(
                    f"the server is busy: {waiting} sequences are waiting "
                    f"(limit {self.max_waiting}); retry later"
                )
            self._pending += count
        request_ids = [f"{request_id}-{i}" for i in range(count)]
        stream = RequestStream(request_ids, lambda ids: self._commands.put(_Abort(ids)))
        stream.constraint_param = constraint_param
        per_choice = [prompt for prompt in prompts for _ in range(params.n)]
        self._commands.put(
            _Add(stream, per_choice, params, trace, grammar, cache_salt, embed, score)
        )
        await stream.admitted()
        return stream

    async def run_traced(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        trace: object,
        grammar: CompiledGrammar | None = None,
        cache_salt: int | None = None,
    ) -> Generation:
        """Run one request with a tokenmill.inspect.trace.Trace recording every step; for the
        inspector (POST /v1/inspect). The request is aborted if the caller is cancelled."""
        if params.n != 1:
            raise ValueError(f"a traced request makes one completion, not n={params.n}")
        request_id = f"trace-{uuid.uuid4().hex}"
        stream = await self.generate(
            request_id, [prompt_ids], params, trace=trace, grammar=grammar, cache_salt=cache_salt
        )
        return (await stream.collect())[0]

    def stats(self) -> EngineStats:
        """A snapshot for /metrics, read without stopping the engine thread: each number
        is read atomically under the GIL, and may be one step old."""
        kv = self.engine.kv_stats()
        held = sum(1 for block in self.engine.blocks.blocks if block.ref_count > 0)
        queries = kv["prefix_cache_query_tokens"]
        return EngineStats(
            running=kv["running"],
            waiting=kv["waiting"] + self._pending,
            blocks_used=kv["blocks_used"],
            blocks_free=kv["blocks_free"],
            blocks_held=held,
            prefix_cache_hit_rate=kv["prefix_cache_hit_tokens"] / queries if queries else 0.0,
            prefix_cache_disk_hit_tokens=kv["prefix_cache_disk_hit_tokens"],
            prefix_cache_disk_blocks=kv["prefix_cache_disk_blocks"],
            prompt_tokens=self.engine.stats["prompt_tokens"],
            generation_tokens=self.engine.stats["generation_tokens"],
            kv_bytes_per_token=self.engine.cache.bytes_per_token,
            speculative=self.engine.speculative_stats(),
        )

    # ---- the engine thread ----
    def _run(self) -> None:
        while True:
            for command in self._next_commands(block=not self.engine.has_unfinished()):
                if command is None:
                    self._shut_down()
                    return
                try:
                    self._apply(command)
                except Exception:  # keep the loop alive; _add answers its own stream
                    log.exception("engine command %s failed", type(command).__name__)
            if self.engine.has_unfinished():
                self._step()
                give_back_now_and_then()  # steady load never idles: trim now and then

    def _next_commands(self, block: bool) -> list[_Add | _Abort | None]:
        self._beat = time.monotonic()  # the heartbeat: one round (a step) done
        if block:  # idle: nothing pending until a command comes
            self._idle = True
            try:
                commands = [self._commands.get(timeout=TRIM_AFTER_IDLE_S)]
            except queue.Empty:  # idle a while: hand the last burst's freed heap back
                give_back_memory()
                commands = [self._commands.get()]
            self._beat, self._idle = time.monotonic(), False
        else:
            commands = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Add):
            self._add(command)
        else:
            for request_id in command.request_ids:
                if self._live.pop(request_id, None) is not None:
                    self.engine.abort(request_id)

    def _add(self, command: _Add) -> None:
        stream, added = command.stream, []
        try:
            for index, request_id in enumerate(stream.request_ids):
                self.engine.add_request(
                    request_id,
                    command.prompts[index],
                    command.params,
                    completion_index=index % command.params.n,
                    trace=command.trace,
                    grammar=command.grammar,
                    cache_salt=command.cache_salt,
                    group=stream.request_ids[0],  # the API request: its n choices share it
                    embed=command.embed,
                    score=command.score,
                )
                added.append(request_id)
        except Exception as e:  # RequestError is the client's fault; others are ours
            for request_id in added:
                self.engine.abort(request_id)
            if isinstance(e, RequestError):
                stream.post(e)
            else:
                log.exception("adding request %s failed", stream.request_ids[0])
                stream.post(EngineFailure(f"the engine could not add the request: {e}"))
            return
        finally:
            with self._lock:
                self._pending -= len(stream.request_ids)
        for index, request_id in enumerate(stream.request_ids):
            self._live[request_id] = _Live(stream, index)
        stream.post(_ADMITTED)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
            now = time.perf_counter()
            for out in outputs:
                self._deliver(out, now)
        except Exception as e:
            log.exception("engine step failed; failing the %d requests in it", len(self._live))
            self._fail_all(EngineFailure(f"the engine failed while generating: {e}"))

    def _deliver(self, out: RequestOutput, now: float) -> None:
        live = self._live.get(out.request_id)
        if live is None:  # a request the server did not submit
            return
        if out.error is not None:  # this request alone failed: so does its API request
            for request_id in live.stream.request_ids:
                if self._live.pop(request_id, None) is not None and request_id != out.request_id:
                    self.engine.abort(request_id)
            if out.error_param is not None:
                param = live.stream.constraint_param or out.error_param
                live.stream.post(ConstraintFailure(param, out.error))
            else:
                live.stream.post(EngineFailure(out.error))
            return
        if out.token_ids:
            since = live.stream.submitted if live.last_token is None else live.last_token
            histogram = self.metrics.ttft if live.last_token is None else self.metrics.itl
            histogram.observe(now - since)
            live.last_token = now
        if out.finished:
            self.metrics.e2e.observe(now - live.stream.submitted)
            del self._live[out.request_id]
        live.stream.post((live.index, out))

    def _fail_all(self, error: Exception) -> None:
        streams = {id(live.stream): live.stream for live in self._live.values()}
        for request_id in list(self._live):
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("aborting %s failed", request_id)
        self._live.clear()
        for stream in streams.values():
            stream.post(error)

    def _shut_down(self) -> None:
        """Fail everything in flight or still queued: the server is going away."""
        error = EngineFailure("the server is shutting down")
        self._fail_all(error)
        for command in self._next_commands(block=False):
            if isinstance(command, _Add):
                with self._lock:
                    self._pending -= len(command.stream.request_ids)
                command.stream.post(error)
