"""`tokenmill bench --rerank`: reranking throughput and agreement, tokenmill beside
llama.cpp's reranking mode (llama-cpp-python, `embedding=True, pooling_type=RANK`) on the
same reranker GGUF.

    model     --model's reranker GGUF (its head as cls.output), or random weights of
              Qwen3-Reranker-0.6B's shape (bench/shapes.py's qwen3-0.6b made a reranker:
              the cls.output rows "no" and "yes"), in --shape's file type (q8_0 unless
              given), written once into the cache.
    work      one query of QUERY_TOKENS tokens and N documents (DOCUMENTS; --quick 8) of
              --prompt-len tokens (default 200), random ids of the vocabulary; each pair is
              BOS, the query, the document: the same ids to both engines.
    a run     scoring all N pairs. tokenmill's engine takes them as N requests and runs
              them through its batched prefill (its prefix cache off, so the shared query
              is computed N times, as llama.cpp computes it); llama.cpp decodes one pair a
              batch, as llama-server's /rerank runs one task per document. A warm-up run
              each, then --runs runs, the engines alternating; documents/s = N / the
              median run's seconds.
    check     both engines' P(yes) of every pair (llama.cpp's softmax over the head's two
              outputs; tokenmill's sigmoid of their difference: the same number): the
              largest difference, and whether the two orders agree on the top 5.

Both engines run in this process, one at a time, on --threads threads.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from tokenmill.bench import shapes
from tokenmill.bench.engines import log

DEFAULT_SHAPE = "qwen3-0.6b:q8_0"
QUERY_TOKENS = 16
DOCUMENTS, QUICK_DOCUMENTS = 32, 8


def pairs(vocab: int, bos: int | None, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n prompts [BOS] + query + document of random ids (past the first 100, which hold a
    vocabulary's control tokens)."""
    rng = np.random.default_rng(seed)
    query = rng.integers(100, vocab, QUERY_TOKENS).tolist()
    head = [bos] if bos is not None else []
    return [head + query + rng.integers(100, vocab, length).tolist() for _ in range(n)]


class Tokenmill:
    def __init__(self, path: Path, threads: int, context: int):
        from tokenmill import LLM

        self.llm = LLM(
            str(path), threads=threads, kv_cache_memory=f"{context}tok",
            enable_prefix_caching=False,
        )  # fmt: skip
        self.engine = self.llm.engine
        self.scorer = self.engine.scorer  # a file that cannot rank fails here, before timing

    def scores(self, prompts: list[list[int]]) -> list[float]:
        ids = [f"rerank-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            self.engine.add_request(rid, prompt, score=True)
        found: dict[str, float] = {}
        while len(found) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    if out.embedding is None:
                        raise RuntimeError(f"{out.request_id} ended without a score")
                    found[out.request_id] = out.embedding[0]
        return [found[rid] for rid in ids]


class LlamaCpp:
    def __init__(self, path: Path, threads: int, context: int):
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=str(path), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK,
            n_ctx=context, n_batch=context, n_ubatch=context, n_threads=threads,
            n_threads_batch=threads, verbose=False,
        )  # fmt: skip

    def scores(self, prompts: list[list[int]]) -> list[float]:
        from llama_cpp import _internals as internals

        out = []
        for prompt in prompts:
            self.llm._ctx.kv_cache_clear()
            batch = internals.LlamaBatch(n_tokens=len(prompt), embd=0, n_seq_max=1, verbose=False)
            batch.add_sequence(prompt, 0, True)  # every row an output, as RANK pooling asks
            self.llm._ctx.decode(batch)
            # RANK pooling leaves the head's outputs for the sequence: [P(no), P(yes)]
            ptr = self.llama_cpp.llama_get_embeddings_seq(self.llm._ctx.ctx, 0)
            out.append(float(ptr[1]))
        return out


def cmd_rerank(args: argparse.Namespace) -> None:
    from tokenmill.engine.llm_engine import resolve_model

    if args.model is not None and args.shape is not None:
        raise ValueError("--shape and --model each name the model; choose one")
    if args.model is not None:
        path = resolve_model(args.model)
    else:
        spec = args.shape or DEFAULT_SHAPE
        path = shapes.cached(spec if ":" in spec else f"{spec}:q8_0", reranker=True, log=log)
    threads = args.threads or 2
    length = args.prompt_len[0] if args.prompt_len else 200
    n = QUICK_DOCUMENTS if args.quick else DOCUMENTS
    context = 1 + QUERY_TOKENS + length + 16
    ours = Tokenmill(path, threads, max(context * n, 512))
    vocab = ours.engine.config.vocab_size
    prompts = pairs(vocab, ours.engine.tokenizer.bos_token_id, n, length)
    theirs = LlamaCpp(path, threads, context)
    engines = {"tokenmill": ours, "llama.cpp": theirs}
    times: dict[str, list[float]] = {name: [] for name in engines}
    scores: dict[str, list[float]] = {}
    log(f"{path.name}: {n} documents of {length} tokens after a {QUERY_TOKENS}-token query, "
        f"{threads} threads, {args.runs} runs")  # fmt: skip
    for run in range(args.runs + 1):  # run 0 warms up
        for name, engine in engines.items():
            start = time.perf_counter()
            scores[name] = engine.scores(prompts)
            if run:
                times[name].append(time.perf_counter() - start)
    rates = {name: n / statistics.median(t) for name, t in times.items()}
    diff = max(abs(a - b) for a, b in zip(scores["tokenmill"], scores["llama.cpp"], strict=True))
    top = [sorted(range(n), key=lambda i, s=s: -s[i])[:5] for s in scores.values()]
    print(f"documents/s: tokenmill {rates['tokenmill']:.2f}, llama.cpp {rates['llama.cpp']:.2f} "
          f"= {rates['tokenmill'] / rates['llama.cpp']:.2f}x")  # fmt: skip
    print(
        f"scores: largest difference {diff:.4f}; top 5 {'agree' if top[0] == top[1] else 'differ'}"
    )
