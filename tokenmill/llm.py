"""The Python API: `LLM(model).generate(prompts, SamplingParams(...))`.

Offline use of the engine: every call adds its requests to the scheduler and steps
the engine until they finish, so many prompts run batched together.

`llm.close()`, or `with LLM(...) as llm:`, ends a parallel run's worker processes and
releases its process group (another parallel LLM can then start in this process);
a closed LLM refuses further calls.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# registers the builder of LLM(..., tensor_parallel_size=2) runs with engine/build.py
import tokenmill.distributed.build  # noqa: F401
from tokenmill.engine.llm_engine import LLMEngine, RequestOutput, TokenLogprob
from tokenmill.sampling import FinishReason, SamplingParams
from tokenmill.tokenizer.reasoning import AUTO
from tokenmill.tokenizer.reasoning import resolve as resolve_reasoning

Prompt = str | list[int]


@dataclass
class Timings:
    time_to_first_token: float  # seconds from arrival to the first token
    total: float  # seconds from arrival to finish
    prefill_tokens: int  # prompt tokens actually computed (not served by the prefix cache)
    output_tokens: int

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.time_to_first_token if self.time_to_first_token else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode_time = self.total - self.time_to_first_token
        return (self.output_tokens - 1) / decode_time if decode_time > 0 else 0.0


@dataclass
class RerankResult:
    index: int  # the document's place in the list given
    score: float  # its relevance to the query, in [0, 1]
    document: str


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None
    timings: Timings | None = None
    # With SamplingParams.reasoning (LLM.chat on a reasoning model): the thinking, and
    # text is the answer after it; None when the output was not split.
    reasoning: str | None = None


@dataclass
class Output:
    """One prompt's result: `outputs` holds its n completions; the first one's fields are
    also available directly (`out.text`)."""

    prompt_token_ids: list[int]
    outputs: list[Completion] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @property
    def timings(self) -> Timings | None:
        return self.outputs[0].timings

    @property
    def reasoning(self) -> str | None:
        return self.outputs[0].reasoning


def _timings(out: RequestOutput, prefill_tokens: int) -> Timings:
    end = out.finish_time or out.first_token_time or out.arrival
    first = out.first_token_time or end
    return Timings(first - out.arrival, end - out.arrival, prefill_tokens, out.num_output_tokens)


def _as_batch(prompts: Prompt | list[Prompt], name: str) -> list[Prompt]:
    """One prompt (a string or a token-id list) as a batch of one; a batch as it is."""
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(
            f"{name} must be a string, a list of token ids, or a non-empty list of them"
        )
    return prompts


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        **engine_kwargs,
    ):
        """model: a checkpoint folder, a .gguf file or a known model name (None: the default,
        SmolLM2-135M-Instruct). Other keywords go to LLMEngine (kv_cache_memory,
        max_num_seqs, max_num_batched_tokens, block_size, threads...)."""
        self.engine = LLMEngine(model, dtype=dtype, device=device, **engine_kwargs)
        self._ids = itertools.count()
        self.closed = False

    def close(self) -> None:
        """Stop a parallel run's other ranks (their processes end) and release its
        process group; idempotent. Later generate/stream/chat calls raise RuntimeError."""
        self.closed = True
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this LLM is closed; create a new one")

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ------------------------------------------------------------------
    def generate(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None
    ) -> list[Output]:
        """Generate for one prompt or a list of them (strings or token-id lists), batched."""
        self._check_open()
        params = params or SamplingParams()
        prompts = _as_batch(prompts, "prompts")
        results: list[Output] = []
        owners: dict[str, tuple[Output, int]] = {}
        pieces: dict[str, list[RequestOutput]] = {}
        try:
            for prompt in prompts:
                result = Output(prompt_token_ids=[])
                results.append(result)
                for index in range(params.n):
                    rid = f"gen-{next(self._ids)}"
                    self.engine.add_request(rid, prompt, params, completion_index=index)
                    owners[rid] = (result, index)
                    pieces[rid] = []
            while any(not p or not p[-1].finished for p in pieces.values()):
                for out in self.engine.step():
                    if out.request_id in pieces:
                        pieces[out.request_id].append(out)
        except BaseException:
            for rid in owners:
                self.engine.abort(rid)
            raise
        for rid, parts in pieces.items():
            result, index = owners[rid]
            last = parts[-1]
            seq_prefill = last.num_prompt_tokens - last.num_cached_tokens
            completion = Completion(
                text="".join(p.text for p in parts),
                token_ids=[t for p in parts for t in p.token_ids],
                finish_reason=last.finish_reason,
                logprobs=[lp for p in parts for lp in p.logprobs]
                if params.logprobs is not None
                else None,
                timings=_timings(last, seq_prefill),
                reasoning="".join(p.reasoning for p in parts) if params.reasoning else None,
            )
            result.outputs.append(completion)
            result.num_cached_tokens = last.num_cached_tokens
        for result, prompt in zip(results, prompts, strict=True):
            result.prompt_token_ids = self.engine.encode_prompt(prompt)
        return results

    def embed(self, texts: Prompt | list[Prompt]) -> list[list[float]]:
        """One embedding per text (or token-id list), pooled as the model's folder says
        (engine/pooling.py: sentence-transformers' modules.json, else the last token,
        L2-normalized). All run batched through the engine's prefill; nothing decodes."""
        self._check_open()
        return self._pooled(_as_batch(texts, "texts"), "embed")

    def rerank(
        self,
        query: str,
        documents: list[str],
        *,
        top_n: int | None = None,
        instruction: str | None = None,
    ) -> list[RerankResult]:
        """The documents ordered by their relevance to `query`, most relevant first (at
        most top_n of them): a reranker's score of each pair (engine/scoring.py: a
        *ForSequenceClassification head, or a yes/no model's P(yes)), all pairs batched
        through the prefill. instruction: a yes/no reranker's task line."""
        self._check_open()
        scores = self.score(query, documents, instruction=instruction)
        ranked = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
        return [RerankResult(i, scores[i], documents[i]) for i in ranked]

    def score(
        self, query: str, documents: str | list[str], *, instruction: str | None = None
    ) -> list[float]:
        """The relevance in [0, 1] of each document to `query`, in the documents' order."""
        self._check_open()
        documents = [documents] if isinstance(documents, str) else list(documents)
        if not isinstance(query, str) or not all(isinstance(d, str) for d in documents):
            raise ValueError("score takes a query string and document strings")
        scorer = self.engine.scorer
        prompts = [scorer.prompt(query, d, instruction) for d in documents]
        return [v[0] for v in self._pooled(prompts, "score")]

    def _pooled(self, prompts: list[Prompt], kind: str) -> list[list[float]]:
        """Each prompt's pooled vector (kind "embed") or [score] (kind "score"), in order."""
        vectors: dict[str, list[float] | None] = {}
        try:
            for prompt in prompts:
                rid = f"{kind}-{next(self._ids)}"
                self.engine.add_request(rid, prompt, embed=kind == "embed", score=kind == "score")
                vectors[rid] = None
            left = set(vectors)
            while left:
                for out in self.engine.step():
                    if out.request_id in left and out.finished:
                        left.discard(out.request_id)
                        if out.embedding is None:  # e.g. a prompt larger than the KV pool
                            raise RuntimeError(
                                f"{kind} {out.request_id} ended without a vector "
                                f"({out.finish_reason})"
                            )
                        vectors[out.request_id] = out.embedding
        except BaseException:
            for rid in vectors:
                self.engine.abort(rid)
            raise
        return [v for v in vectors.values() if v is not None]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the generated text piece by piece as it is produced."""
        for out in self.stream_outputs(prompt, params):
            if out.text:
                yield out.text

    def stream_outputs(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Like `stream`, but yields the engine's per-step outputs (tokens, timings)."""
        self._check_open()
        params = params or SamplingParams()
        rid = f"stream-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort(rid)

    def chat_prompt(self, messages: list[dict], template_vars: dict | None = None) -> list[int]:
        """Render messages with the model's chat template and tokenize them, as the server's
        chat route does (tokenizer/chat.py: a history's tool calls and results are written
        out as text for a template that knows nothing of tools); special-token text inside
        a message stays text (only the template opens and closes turns).
        template_vars: further template variables, such as {"enable_thinking": False}."""
        return self.engine.encode_chat(messages, template_vars=template_vars)

    def chat(
        self,
        messages: list[dict],
        params: SamplingParams | None = None,
        template_vars: dict | None = None,
        reasoning_parser: str | None = AUTO,
    ) -> Output:
        """The model's answer to messages. On a reasoning model (reasoning_parser "auto":
        its chat template mentions <think>; or a format's name, "think") the thinking is
        `.reasoning` and `.text` the answer after it, and stop strings and a constraint
        apply to the answer, as the server's chat route does; None leaves the output
        whole. params.reasoning, when set, wins."""
        params = params or SamplingParams()
        name = resolve_reasoning(reasoning_parser or "none", self.tokenizer.chat_template)
        if name is not None and params.reasoning is None:
            params = dataclasses.replace(params, reasoning=name)
        return self.generate([self.chat_prompt(messages, template_vars)], params)[0]
