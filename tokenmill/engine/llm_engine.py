"""The engine loop: requests in, one scheduled batch per step, text deltas out.

    add_request -> Scheduler.waiting
    step():  Scheduler.schedule()        which sequences, how many tokens each
             ModelRunner.run()           one forward pass -> logits of the rows that sample
             Sampler()                   next token per sequence (per-request params,
                                         grammar masks for constrained rows)
             speculation (speculative=)  a sequence's guesses run as 1 + k rows; each
                                         row sampled in turn, while it matches its guess
                                         (engine/speculative.py); the rejected rows'
                                         blocks given back
             detokenize + stop checks    text delta, finish_reason (a reasoning
                                         request: its reasoning apart, stops and
                                         grammar on the answer after it)
             free finished sequences' blocks at once
    abort(request_id) frees a request's blocks at once.
    add_request(..., embed=True): an embedding, prefill only; the step that runs its last
    prompt token finishes it with RequestOutput.embedding (engine/pooling.py), no decode.

The server drives this object from one thread; `LLM` (tokenmill/llm.py) wraps it
for offline use. Around the loop, each in its own module:
    engine/build.py    the constructor's arguments -> the model, KV pool and runner
                       (a parallel run's through tokenmill/distributed/build.py)
    engine/inputs.py   a prompt -> checked token ids (encode_prompt, RequestError)
    engine/report.py   what runs, in words (info, describe, the prefill path)
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmill.checks import ParamError
from tokenmill.engine import build, free_cores, inputs, report
from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.build import load_tokenizer, model_eos_ids  # re-exported (the CLI)
from tokenmill.engine.disk_cache import DiskPrefixCache, model_key
from tokenmill.engine.hooks import EngineView
from tokenmill.engine.inputs import RequestError  # re-exported (the server, the tests)
from tokenmill.engine.kv_cache import BLOCK_SIZE
from tokenmill.engine.pooling import Pooling, PoolingError, PoolState, read_pooling
from tokenmill.engine.scheduler import ScheduledChunk, Scheduler
from tokenmill.engine.scoring import Scorer, ScoringError, classifier_architecture, read_scorer
from tokenmill.engine.sequence import Sequence, Status
from tokenmill.engine.speculative import SpeculativeConfig, Speculator
from tokenmill.hub import resolve_model  # re-exported (tokenmill bench)
from tokenmill.sampling import (
    FinishReason,
    Sampler,
    SamplingParams,
    SamplingState,
    StopStringMatcher,
    dry,
    finish_reason,
    is_stop_token,
)
from tokenmill.sampling.dry import Breakers
from tokenmill.sampling.grammar import CompiledGrammar, GrammarCompiler, GrammarError
from tokenmill.tokenizer import IncrementalDetokenizer
from tokenmill.tokenizer.chat import ToolOffer, encode_chat
from tokenmill.tokenizer.reasoning import ReasoningParser, start_parser
from tokenmill.tokenizer.tokenizer import TextTooLong
from tokenmill.units import parse_memory

log = logging.getLogger("tokenmill.engine")

# Prompt tokens decoded to see whether the template opened or closed the reasoning tag at
# the end of the prompt (tokenizer/reasoning.py's start_parser): a tag and a turn marker.
REASONING_TAIL_TOKENS = 16

__all__ = [
    "LLMEngine",
    "RequestOutput",
    "TokenLogprob",
    "RequestError",
    "load_tokenizer",
    "model_eos_ids",
    "resolve_model",
]


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # alternatives: id -> logprob


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas, not totals)."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    arrival: float
    first_token_time: float | None
    finish_time: float | None
    # Set (with finish_reason ERROR) when this request alone failed in a step, e.g. its
    # sampling or its grammar raised: one line for the client; the rest of the step ran.
    error: str | None = None
    # ... and when the request's own constraint failed (GrammarLimitError): its kind, so
    # that the server answers 400 naming it rather than 500.
    error_param: str | None = None
    # With params.reasoning: the reasoning's delta (text holds the answer's alone).
    reasoning: str = ""
    # An embedding request's pooled vector [hidden_size] (add_request(embed=True)); it
    # comes in its one output, finished, with no tokens.
    embedding: list[float] | None = None
    # In a finished output: the stop string that ended the answer, if one did (Anthropic's
    # API names it in stop_sequence).
    stop_string: str | None = None


class _Request:
    """Engine-side bookkeeping around a Sequence: text state and stop matching.

    reasoning: the parser splitting the text, for a request with params.reasoning whose
    prompt left thinking on. pending_grammar: its constraint, held back until the
    reasoning ends (vLLM's reasoning-aware structured output); the sampler sees no
    grammar on the sequence until then."""

    def __init__(
        self,
        seq: Sequence,
        detok: IncrementalDetokenizer,
        stops: StopStringMatcher,
        reasoning: ReasoningParser | None = None,
    ):
        self.seq, self.detok, self.stops = seq, detok, stops
        self.reasoning = reasoning
        self.pending_grammar = None


class LLMEngine:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        kv_cache_memory: int | str | None = None,
        kv_cache_dtype: str = "auto",
        activation_bits: int = 16,
        block_size: int = BLOCK_SIZE,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_prefix_caching: bool = True,
        threads: int | None = None,
        quantization: str = "auto",
        progress=None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        speculative: str | dict | SpeculativeConfig | None = None,
        prefix_cache_dir: str | Path | None = None,
        prefix_cache_disk_size: int | str = "10GiB",
    ):
        """quantization: "auto" keeps a GGUF file's weights as stored (packed blocks, 16-bit
        floats) and a float checkpoint's in its own dtype, for the native CPU kernels;
        "none" loads torch Linears in `dtype` (exact, what the oracle tests compare);
        "gguf", "float", "q8", "q4" force a scheme (see models/quantize.py).
        progress(done, total) is called while weights load.
        kv_cache_dtype: "auto" (the activations' dtype), "float32", "float16", "bfloat16"
        or "q8_0" (llama.cpp's 8-bit blocks, 34 bytes per 32 values): what the KV cache
        stores (16 bits hold twice the tokens in the same memory, q8_0 3.76 times).
        activation_bits: 16 (the default) or 8: what packed weights' kernels quantize
        activations to (engine/build.py's set_activation_bits). 16 keeps greedy output
        the float model's; 8 is llama.cpp's q8 scheme, faster on VNNI and AVX2 CPUs.
        tensor_parallel_size / pipeline_parallel_size: run the model over that many
        processes (tokenmill/distributed: spawned on this machine, or torchrun's).
        speculative: "ngram", "draft:PATH", or {"method": "ngram", "k": 4,
        "prompt_lookup_max": 4, "prompt_lookup_min": 1, "max_running": 4} or {"draft":
        PATH, "k": 4, "draft_kv_cache_memory": "128MiB"} (engine/speculative.py); None:
        off. A draft model must have this model's tokenizer; it runs as an engine of its
        own, on the same device, dtype, threads and quantization.
        prefix_cache_dir: also keep the prefix cache's full blocks in this folder, read back
        after a restart (engine/disk_cache.py), at most prefix_cache_disk_size bytes of
        them (least recently used evicted); None: in memory only."""
        spec_config = SpeculativeConfig.parse(speculative)  # a bad value fails before loading
        parts = build.build(
            model, dtype=dtype, device=device, kv_cache_memory=kv_cache_memory,
            kv_cache_dtype=kv_cache_dtype, activation_bits=activation_bits,
            block_size=block_size, threads=threads,
            quantization=quantization,
            progress=progress, tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
        )  # fmt: skip
        self.path, self.device, self.dtype = parts.path, parts.device, parts.dtype
        self.config, self.tokenizer = parts.config, parts.tokenizer
        self.eos_token_ids, self.quantization = parts.eos_token_ids, parts.quantization
        self.activation_bits = activation_bits
        run = parts.model
        self.model, self.cache, self.runner = run.model, run.cache, run.runner
        self.parallel = run.parallel  # the distributed Runtime of a run over ranks, or None
        self.parallel_plan = run.parallel_plan
        # a parallel run's ranks keep the cores they were pinned to
        self._threads_asked = asked = (
            torch.get_num_threads() if device == "cpu" and self.parallel is None else 1
        )
        if asked > 1:  # (holds no reference to the engine: see close)
            self.model.before_layer = functools.partial(free_cores.machine().apply, asked)
        # The other ranks stop when this engine is closed, dropped or the process exits;
        # the finalizer holds the runtime, not the engine, so dropping the last reference
        # to the engine frees it (an atexit-registered bound method kept it alive).
        self._stop_parallel = (
            weakref.finalize(self, self.parallel.stop) if self.parallel is not None else None
        )
        self._view: EngineView | None = None

        # ---- block manager, scheduler ----
        self.blocks = BlockManager(self.cache.num_blocks, block_size, enable_prefix_caching)
        self.disk_cache: DiskPrefixCache | None = None
        if prefix_cache_dir is not None and enable_prefix_caching:
            if self.parallel is not None:
                raise ParamError.named(
                    "prefix_cache_dir", " is not supported on a tensor- or pipeline-parallel run"
                )
            try:
                limit = parse_memory(prefix_cache_disk_size)
            except ValueError:
                limit = -1
            if limit is None or limit < 1:
                raise ParamError.named(
                    "prefix_cache_disk_size",
                    f" must be a size like '10GiB' or '500MB', got {prefix_cache_disk_size!r}",
                )
            key = model_key(self.path, self.cache)
            self.disk_cache = DiskPrefixCache(prefix_cache_dir, self.cache, key, limit)
            self.blocks.store = self.disk_cache
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens)
        self.sampler = Sampler()
        self.max_model_len = min(self.config.max_position, self.cache.capacity_tokens)
        self.requests: dict[str, _Request] = {}
        self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size, self.eos_token_ids)
        self._dry_breakers: dict[tuple[str, ...], Breakers] = {}
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "prefill_tokens_computed": 0}
        self.speculator = None
        if spec_config is not None:
            draft = None
            if spec_config.method == "draft":
                draft = LLMEngine(
                    spec_config.draft, dtype=dtype, device=device,
                    kv_cache_memory=spec_config.draft_kv_cache_memory, block_size=block_size,
                    max_num_seqs=1, max_num_batched_tokens=max_num_batched_tokens,
                    threads=threads, quantization=quantization,
                )  # fmt: skip
                if draft.tokenizer.token_bytes() != self.tokenizer.token_bytes():
                    raise ParamError.named(
                        "speculative",
                        f" draft {spec_config.draft} has another tokenizer than the model: "
                        "its guesses would be other tokens",
                    )
            self.speculator = Speculator(spec_config, draft)
            self.scheduler.propose = self._propose
        self._pooling: Pooling | None = None
        self._scorer: Scorer | None = None

    def close(self) -> None:
        """Stop the other ranks of a parallel run, wait for their processes to end and
        release the process group, so that another parallel engine can start in this
        process (nothing to do on one process); write the prefix cache's queued blocks to
        disk. Idempotent."""
        if self.disk_cache is not None:
            self.disk_cache.flush()
        if self._stop_parallel is not None:
            self._stop_parallel()  # runs once: later calls do nothing

    # ------------------------------------------------------------------
    def info(self) -> dict[str, str]:
        """What runs (engine/report.py): for /metrics' build info and the inspector."""
        return report.info(
            self.path, self.device, self.dtype, self.quantization, self.activation_bits
        )

    def view(self) -> EngineView:
        """The read-only view a trace gets at the end of each step (engine/hooks.py)."""
        if self._view is None:
            from tokenmill.models.positions import position_sample  # for traces only

            eos = frozenset(self.eos_token_ids)
            self._view = EngineView(
                model_name=self.path.name,
                config=self.config,
                tokenizer=self.tokenizer,
                info=self.info(),
                decode_path=self.model.decode_path(),
                parallel=self.parallel_plan if self.parallel is not None else None,
                position_encoding=functools.partial(position_sample, self.model),
                kv_bytes_per_token=self.cache.bytes_per_token,
                block_size=self.cache.block_size,
                kv_capacity_tokens=self.cache.capacity_tokens,
                kv_capacity_bytes=self.cache.nbytes,
                pool_blocks_total=self.blocks.num_blocks,
                pool_blocks_used=lambda: self.blocks.num_used,
                is_stop_token=functools.partial(is_stop_token, eos_token_ids=eos),
                speculative_stats=self.speculative_stats,
            )
        return self._view

    def describe(self) -> str:
        """One line on what runs (engine/report.py)."""
        world = self.parallel.world if self.parallel is not None else None
        return report.describe(
            self.path, self.config, self.dtype, self.quantization, self.cache, world,
            self.parallel_plan, report.weight_forms(self.model),
        )  # fmt: skip

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (engine/inputs.py), checked against this model."""
        return inputs.encode_prompt(
            self.tokenizer, prompt, self.max_model_len, self.config.vocab_size
        )

    def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """Compile params' structured-output constraint (None without one).

        Thread-safe and cached by source; the server calls it off the engine thread and
        before queueing, so a bad schema is a 400 and a slow one never stalls a step.
        Raises GrammarError (a ValueError) naming the problem."""
        constraint = params.constraint
        return None if constraint is None else self.grammars.compile(*constraint)

    def dry_breakers(self, params: SamplingParams) -> Breakers | None:
        """params' DRY sequence breakers found in this model's vocabulary (None when DRY
        is off); cached by breaker list, since finding them reads every token's text."""
        if not params.dry:
            return None
        key = tuple(params.dry_sequence_breakers)
        if key not in self._dry_breakers:
            encode = functools.partial(
                self.tokenizer.encode, add_special_tokens=False, parse_special=False
            )
            token_bytes = self.tokenizer.token_bytes()
            self._dry_breakers[key] = dry.sequence_breakers(token_bytes, encode, key)
        return self._dry_breakers[key]

    def encode_chat(
        self,
        messages: list[dict],
        tools: ToolOffer | None = None,
        template_vars: dict | None = None,
    ) -> list[int]:
        """Token ids of a conversation prepared and rendered by tokenizer/chat.py's
        encode_chat (the model's chat template, tools, the tool-result fallback; messages'
        text kept as text). tools: what the request offers (the server's ToolRequest);
        template_vars: further template variables ({"enable_thinking": False}).
        ChatTemplateError (a ValueError) for a template that fails or goes over its limits;
        RequestError for a prompt that cannot fit in the context."""
        try:
            return encode_chat(
                self.tokenizer,
                messages,
                tools,
                max_tokens=self.max_model_len,
                template_vars=template_vars,
            )
        except TextTooLong as e:
            raise RequestError(self._too_long(e), "messages") from None

    @property
    def pooling(self) -> Pooling:
        """How this model pools an embedding (engine/pooling.py: sentence-transformers'
        modules.json in the model folder, else last token, normalized). PoolingError (a
        ValueError) for a folder that asks for what is not implemented."""
        if self._pooling is None:
            self._pooling = read_pooling(self.path if self.path.is_dir() else None)
        return self._pooling

    def _too_long(self, e: TextTooLong) -> str:
        return inputs.too_long(e, self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        completion_index: int = 0,
        trace=None,
        grammar: CompiledGrammar | None = None,
        cache_salt: int | None = None,
        group: str | None = None,
        embed: bool = False,
        score: bool = False,
    ) -> int:
        """Queue a request; returns its prompt length in tokens.

        trace: a tokenmill.inspect.trace.Trace to record this request's pipeline step by step.
        cache_salt: the prefix-cache scope (block_manager.salt_root): the request reuses
        and names cached blocks only under it; None is the shared cache.
        group: whom the request counts against for fair admission (the scheduler): the
        n choices of one API request share one; None gives it a group of its own.
        grammar: params' constraint already compiled by compile_grammar; compiled here
        (on the caller's thread) when not given.
        embed: run the prompt only and answer its pooled final hidden state
        (RequestOutput.embedding, engine/pooling.py); params are not used.
        score: run the prompt only and answer its relevance (a reranker's pair, built by
        scorer.prompt) as RequestOutput.embedding = [score] (engine/scoring.py)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running", "request_id")
        ids = self.encode_prompt(prompt)
        pool = self._pool_state(len(ids), score) if embed or score else None
        if pool is None and self.classifier is not None:
            raise RequestError(
                f"{self.path.name} is a sequence classifier ({self.classifier}): it "
                "scores pairs (rerank, score), it does not generate",
                "model",
            )
        if pool is None and len(ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens, more than the model's context of "
                f"{self.max_model_len - 1} (leaving room for at least one generated token)",
                "prompt",
            )
        try:
            if grammar is None:
                grammar = self.compile_grammar(params)
            state = SamplingState.create(
                params,
                ids,
                self.device,
                vocab_size=self.config.vocab_size,
                completion_index=completion_index,
                grammar=grammar,
                dry_breakers=self.dry_breakers(params),
            )
        except ValueError as e:  # GrammarError included
            raise RequestError(str(e), getattr(e, "param", None)) from None
        seq = Sequence(
            request_id, ids, params, state, trace=trace, cache_salt=cache_salt, group=group,
            pool=pool,
        )  # fmt: skip
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=ids)
        req = _Request(seq, detok, StopStringMatcher(params.stop), self._reasoning(params, ids))
        if req.reasoning is not None and state.grammar is not None and req.reasoning.reasoned:
            # The prompt opened the reasoning: the constraint starts after it. (An answer
            # that may open it itself is constrained from its first token: the grammar
            # decides whether it may think.)
            req.pending_grammar, state.grammar = state.grammar, None
        self.requests[request_id] = req
        self.scheduler.add(seq)
        self.stats["prompt_tokens"] += len(ids)
        return len(ids)

    @functools.cached_property
    def classifier(self) -> str | None:
        """A *ForSequenceClassification checkpoint's architecture (or a GGUF reranker's):
        it scores, never generates. Read on the first request, not at every start (a GGUF
        is parsed again for it)."""
        return classifier_architecture(self.path)

    @property
    def scorer(self) -> Scorer:
        """How this model ranks documents (engine/scoring.py); ScoringError (a ValueError)
        when it cannot."""
        if self._scorer is None:
            self._scorer = read_scorer(self.path, self.tokenizer, self.model.unembed, self.dtype)
        return self._scorer

    def _pool_state(self, num_tokens: int, score: bool = False) -> PoolState:
        """An embedding request's pooling state, once its prompt is known to fit (no token
        is generated, so the whole context is the limit)."""
        if self.parallel is not None:
            raise RequestError("embeddings are not supported on a parallel run", "input")
        if num_tokens > self.max_model_len:
            raise RequestError(
                f"input has {num_tokens} tokens, more than the model's context of "
                f"{self.max_model_len}",
                "input",
            )
        try:
            if score:  # the last token's state, as it is, through the scorer's head
                return PoolState(Pooling("last", normalize=False), self.scorer.score)
            return PoolState(self.pooling)
        except (PoolingError, ScoringError) as e:
            raise RequestError(str(e), "model") from None

    def _reasoning(self, params: SamplingParams, ids: list[int]) -> ReasoningParser | None:
        """The reasoning parser of a request with params.reasoning (None without, or when
        its prompt switched thinking off), from the end of its prompt's text."""
        if params.reasoning is None:
            return None
        tail = self.tokenizer.decode(ids[-REASONING_TAIL_TOKENS:])
        try:
            return start_parser(params.reasoning, tail)
        except ValueError as e:
            raise RequestError(str(e), "reasoning") from None

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. False if it was not running."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req.seq)
        req.seq.finish_reason = FinishReason.ABORT
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        if self._threads_asked > 1:  # no more threads than the machine leaves free
            free_cores.machine().apply(self._threads_asked)
        chunks = self.scheduler.schedule()
        if not chunks:
            return self._reject_unschedulable()
        traced = [c for c in chunks if c.seq.trace is not None]
        for chunk in traced:
            chunk.seq.trace.on_step_begin(chunk.seq, chunk.num_tokens, chunk.proposal)
        logits, sampled = self.runner.run(chunks)
        for chunk in chunks:
            seq = chunk.seq
            in_prompt = max(
                0, min(len(seq.prompt_ids), seq.num_computed + chunk.num_tokens) - seq.num_computed
            )
            seq.num_prefill_computed += in_prompt
            self.stats["prefill_tokens_computed"] += in_prompt
            # a verification's guesses count as computed once accepted (_verify)
            seq.num_computed += chunk.num_tokens - len(chunk.proposal)
            self.blocks.commit_full_blocks(seq)
        plain = [r for r, i in enumerate(sampled) if not chunks[i].proposal]
        if len(plain) < len(sampled):
            logits_all, logits = logits, logits[plain]
        seqs = [chunks[sampled[r]].seq for r in plain]
        picks = self._sample(logits, seqs) if seqs else []
        now = time.perf_counter()
        outputs = [
            self._embedded(c.seq, now)
            for c in chunks
            if c.seq.pool is not None and c.seq.num_computed == len(c.seq)
        ]
        # Per sequence from here: what one request's sampling state, grammar or trace
        # raises fails that request alone, never the others in the step.
        for row, (seq, pick) in enumerate(zip(seqs, picks, strict=True)):
            try:
                if isinstance(pick, Exception):
                    raise pick
                token, lp = pick
                if seq.trace is not None:  # before the state records the new token
                    seq.trace.on_sample(logits[row], seq.sampling, token)
                outputs.append(self._advance(seq, token, lp, now))
            except Exception as e:
                outputs.append(self._fail(seq, e, now))
        if len(plain) < len(sampled):
            for i, chunk in enumerate(chunks):
                if chunk.proposal:
                    first = sampled.index(i)  # its 1 + k rows are consecutive
                    rows = logits_all[first : first + chunk.num_tokens]
                    outputs.append(self._verify(chunk, rows, now))
        for chunk in traced:
            if chunk.seq.finish_reason is not FinishReason.ERROR:
                chunk.seq.trace.on_step_end(chunk.seq, self.view())
        if self.speculator is not None and len(chunks) == 1 and not traced:
            if chunks[0].proposal or chunks[0].is_decode:  # what a verification must beat
                self.speculator.observe(bool(chunks[0].proposal), time.perf_counter() - start)
        return outputs

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> list[tuple[int, TokenLogprob | None] | Exception]:
        """The next token (and its logprob) of each sampled row, batched. Should the batch
        raise, each row is sampled alone, so the row at fault gets its exception and the
        others their tokens: the same ones, as rows are independent and a bad value fails
        in the checks and filters, before any generator draws (the draw is the sampler's
        last step but the logprobs'). No generator state is saved each step for this."""
        # logits: [B, V], row i for seqs[i]
        try:
            result = self.sampler(logits, [seq.sampling for seq in seqs])
            rows = [(result, i) for i in range(len(seqs))]
        except Exception:
            rows = []
            for i, seq in enumerate(seqs):
                try:
                    rows.append((self.sampler(logits[i : i + 1], [seq.sampling]), 0))
                except Exception as e:
                    rows.append((e, 0))
        picks: list[tuple[int, TokenLogprob | None] | Exception] = []
        for result, i in rows:
            if isinstance(result, Exception):
                picks.append(result)
                continue
            token, lp = result.token_ids[i], None
            if result.logprobs[i] is not None:
                lp = TokenLogprob(token, result.logprobs[i], result.top_logprobs[i] or {})
            picks.append((token, lp))
        return picks

    def _propose(self, seq: Sequence, limit: int) -> list[int]:
        """The scheduler's speculation hook: guesses for a decoding sequence, at most
        `limit` (its share of the step's budget) and no more than can be used: the last
        guess's row must stay inside the context, and 1 + k tokens may come out, no more
        than max_tokens leaves."""
        spec = self.speculator
        if len(self.scheduler.running) > spec.config.max_running or seq.pool is not None:
            return []
        room = min(
            limit,
            self.max_model_len - 1 - len(seq),
            seq.params.max_tokens - len(seq.output_ids) - 1,
        )
        return spec.propose(seq, room) if room > 0 else []

    def _verify(self, chunk: ScheduledChunk, logits: torch.Tensor, now: float) -> RequestOutput:
        """Accept a verification's guesses (engine/speculative.py's rule). logits: [1 + k,
        V], row j scoring what follows guess j (row 0: the sequence's last token). Row j is
        sampled as a plain decode of the tokens so far would be, its token appended
        (penalties, grammar, stops, max_tokens: _advance) and row j + 1 looked at only if
        the token was guess j and the sequence goes on. Then the rejected guesses' blocks
        go back and the accepted ones' are named for the prefix cache. One output for all
        the tokens."""
        seq, guesses = chunk.seq, chunk.proposal
        out: RequestOutput | None = None
        accepted = 0
        # A plain greedy row's token does not depend on the tokens before it: all the rows
        # in one call. (A grammar that starts inside the rows, after a reasoning block,
        # ends that: plain_greedy is checked per row.)
        batch = None
        if seq.sampling.plain_greedy:
            batch = self._sample(logits, [seq] * len(logits))
            if any(isinstance(pick, Exception) for pick in batch):
                batch = None
        for j in range(len(guesses) + 1):
            try:
                if batch is not None and seq.sampling.plain_greedy:
                    pick = batch[j]
                else:
                    pick = self._sample(logits[j : j + 1], [seq])[0]
                if isinstance(pick, Exception):
                    raise pick
                token, lp = pick
                if seq.trace is not None:  # before the state records the new token
                    seq.trace.on_sample(logits[j], seq.sampling, token)
                matched = j < len(guesses) and token == guesses[j]
                accepted += matched
                step = self._advance(seq, token, lp, now)
            except Exception as e:
                step, matched = self._fail(seq, e, now), False
            out = step if out is None else _merge(out, step)
            if not matched or seq.status is Status.FINISHED:
                break
        self.speculator.record(seq, len(guesses), accepted)
        if seq.status is not Status.FINISHED:
            seq.num_computed += accepted
            self.blocks.truncate(seq.block_table, seq.num_computed)
            self.blocks.commit_full_blocks(seq)
        return out

    def _embedded(self, seq: Sequence, now: float) -> RequestOutput:
        """Finish an embedding whose prompt has run: its vector, its blocks freed."""
        self.requests.pop(seq.request_id, None)
        seq.first_token_time = seq.finish_time = now
        seq.finish_reason = FinishReason.STOP
        self.scheduler.finish(seq)
        out = self._output(seq, "", [], [])
        out.embedding = seq.pool.result()
        return out

    def _fail(self, seq: Sequence, error: Exception, now: float) -> RequestOutput:
        """End one request whose step failed: free its blocks, tell its client in one line
        (the traceback goes to the log only)."""
        self.requests.pop(seq.request_id, None)
        seq.finish_reason, seq.finish_time = FinishReason.ERROR, now
        self.scheduler.finish(seq)
        out = self._output(seq, "", [], [])
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        if isinstance(error, GrammarError):  # its constraint: the request's fault, not ours
            log.warning("request %s failed in a step: %s", seq.request_id, error)
            out.error, out.error_param = first_line, error.kind
        else:
            log.error(
                "request %s failed in a step; the others in it carry on",
                seq.request_id,
                exc_info=error,
            )
            out.error = f"this request failed while sampling ({type(error).__name__}: {first_line})"
        return out

    def _advance(
        self, seq: Sequence, token: int, lp: TokenLogprob | None, now: float
    ) -> RequestOutput:
        """Append one sampled token: detokenize, check stops, maybe finish."""
        req = self.requests[seq.request_id]
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.output_ids.append(token)
        seq.sampling.append(token)
        self.stats["generation_tokens"] += 1
        reasoning = ""
        if is_stop_token(token, seq.params, self.eos_token_ids):
            text, hit = "", False  # a stop token's own text is never shown
        else:
            text = req.detok.add(token)
            if req.reasoning is not None:
                reasoning, text = req.reasoning.feed(text)
                if req.pending_grammar is not None and req.reasoning.ended:
                    self._start_grammar(seq, req, text)
            text, hit = req.stops.feed(text)  # stop strings: the answer's text only
        grammar = seq.sampling.grammar
        reason = finish_reason(
            token,
            seq.params,
            self.eos_token_ids,
            len(seq.output_ids),
            num_tokens=len(seq),
            max_model_len=self.max_model_len,
            stop_string=hit,
            grammar_complete=grammar is not None and grammar.finished,
        )
        if reason is not None:
            more_reasoning, more = self._drain(req)  # what was held back
            text, reasoning = text + more, reasoning + more_reasoning
            seq.finish_reason, seq.finish_time = reason, now
            self.scheduler.finish(seq)
            del self.requests[seq.request_id]
        out = self._output(seq, text, [token], [lp] if lp else [])
        out.reasoning = reasoning
        if reason is not None:
            out.stop_string = req.stops.matched
        return out

    def _start_grammar(self, seq: Sequence, req: _Request, content: str) -> None:
        """The reasoning ended in this token: its constraint applies from here. Answer text
        the same token carried past the closing tag goes through the grammar first (as its
        tokens), so the grammar sees the whole answer."""
        grammar, req.pending_grammar = req.pending_grammar, None
        for token_id in self.tokenizer.encode(content, add_special_tokens=False) if content else []:
            grammar.consume(token_id)
        seq.sampling.grammar = grammar

    @staticmethod
    def _drain(req: _Request) -> tuple[str, str]:
        """(reasoning, text) still held back when a request ends: an incomplete character,
        a possible tag or stop-string start ("" text after a stop string)."""
        tail = req.detok.flush()
        reasoning = ""
        if req.reasoning is not None:
            reasoning, tail = req.reasoning.feed(tail)
            more_reasoning, more = req.reasoning.finish()
            reasoning, tail = reasoning + more_reasoning, tail + more
        if req.stops.stopped:
            return reasoning, ""
        tail, hit = req.stops.feed(tail)
        return reasoning, tail if hit else tail + req.stops.flush()

    def _reject_unschedulable(self) -> list[RequestOutput]:
        """Nothing fits: the head waiting request needs more blocks than the whole pool."""
        if not self.scheduler.waiting or self.scheduler.running:
            return []
        seq = self.scheduler.waiting[0]
        req = self.requests.pop(seq.request_id)
        # cut short before its first token, as a context too small for it would be
        seq.finish_reason, seq.finish_time = FinishReason.LENGTH, time.perf_counter()
        self.scheduler.finish(seq)
        reasoning, text = self._drain(req)
        out = self._output(seq, text, [], [])
        out.reasoning = reasoning
        return [out]

    def _output(self, seq: Sequence, text: str, tokens: list[int], lps: list) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            text=text,
            token_ids=tokens,
            logprobs=lps,
            finished=seq.status is Status.FINISHED,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids),
            num_cached_tokens=seq.num_cached_prompt,
            arrival=seq.arrival,
            first_token_time=seq.first_token_time,
            finish_time=seq.finish_time,
        )

    def kv_stats(self) -> dict:
        b = self.blocks
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "blocks_total": b.num_blocks,
            "blocks_free": b.num_free,
            "blocks_used": b.num_used,
            "block_size": b.block_size,
            "prefix_cache_query_tokens": b.query_tokens,
            "prefix_cache_hit_tokens": b.hit_tokens,
            "prefix_cache_disk_hit_tokens": b.store_hit_tokens,
            "prefix_cache_disk_blocks": (
                self.disk_cache.num_blocks if self.disk_cache is not None else 0
            ),
            "preemptions": self.scheduler.num_preemptions,
            # what a token costs in the pool: K and V of every layer, in the cache's dtype
            "kv_cache_dtype": str(self.cache.dtype).removeprefix("torch."),
            "kv_bytes_per_token": self.cache.bytes_per_token,
        }

    def speculative_stats(self) -> dict[str, int | float | str]:
        """Speculation's counters (engine/speculative.py's Speculator.stats: method,
        verification steps, guesses proposed and accepted, acceptance rate); {} when off."""
        return {} if self.speculator is None else self.speculator.stats()


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One request's outputs of one step as one: b's tokens, text and logprobs after a's,
    and b's state (finished, counts, times)."""
    a.text += b.text
    a.reasoning += b.reasoning
    a.token_ids = a.token_ids + b.token_ids
    a.logprobs = a.logprobs + b.logprobs
    for name in ("finished", "finish_reason", "num_output_tokens", "first_token_time",
                 "finish_time", "error", "stop_string"):  # fmt: skip
        setattr(a, name, getattr(b, name))
    return a
