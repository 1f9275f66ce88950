"""`tokenmill bench --context 512,2048,8192`: how prefill and decode speed fall as the context
grows, tokenmill beside llama.cpp, at a KV cache dtype (--kv-cache-dtype).

For each context length C: one prompt of C tokens (fewer where C plus the generated tokens
would pass the model's window: then window - gen, and the row says so) is prefilled, then
`gen` tokens are decoded greedily. Figures are the medians over `runs` runs after a short
warm-up run, each prompt of other token ids and no prefix cache, so every run computes its
whole prompt. The engines
take turns run by run (tokenmill, llama.cpp, tokenmill, ...), so a burst of load from other
processes hits both alike. llama.cpp (llama-cpp-python, when installed) runs the same GGUF
file with flash attention on and the KV type nearest tokenmill's (LLAMA_KV: q8_0 for q8_0,
else its default f16: llama.cpp's flash attention has no f32 cache). Also reported: each
engine's KV bytes per token.

Both engines run in this one process, on the same threads. benchmarks/context.py runs this
same code for several KV dtypes at once.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

# tokenmill's kv_cache_dtype -> llama.cpp's (name, ggml_type, bytes per 32 values)
LLAMA_KV = {
    "q8_0": ("q8_0", 8, 34),
    "float16": ("f16", 1, 64),
    "bfloat16": (
        "f16",
        1,
        64,
    ),  # llama.cpp's bf16 cache has no flash attention on CPU in all builds
    "float32": ("f16", 1, 64),
    "auto": ("f16", 1, 64),
}


def prompt_for(ctx: int, gen: int, window: int, run: int, vocab: int) -> list[int]:
    """Run `run`'s prompt for context ctx: ctx token ids (or window - gen where ctx + gen
    passes the window), other ids each run so no cache could serve one from another."""
    n = min(ctx, window - gen)
    if n < 1:
        raise ValueError(f"--gen-len {gen} leaves no room for a prompt in a {window}-token window")
    return [100 + (run * 7919 + i) % (vocab - 200) for i in range(n)]


class TokenmillContext:
    """tokenmill at one context length: one LLM sized for it, one timed run per call."""

    def __init__(self, path: Path, ctx: int, gen: int, threads: int, kv: str, dtype: str):
        from tokenmill import LLM, SamplingParams

        self.llm = LLM(
            path,
            dtype=dtype,
            kv_cache_memory=f"{ctx + gen + 64}tok",
            threads=threads,
            enable_prefix_caching=False,
            kv_cache_dtype=kv,
        )
        self.params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
        # the pool resident up front, as llama.cpp clears its KV buffer at load: no first
        # touch of its pages in a timed run
        self.llm.engine.cache.make_resident()
        self.kv_name = str(self.llm.engine.cache.dtype).removeprefix("torch.")
        self.kv_bytes_per_token = self.llm.engine.cache.bytes_per_token

    def run(self, prompt: list[int]) -> tuple[float, float]:
        """(prefill tok/s, decode tok/s) of one run."""
        out = self.llm.generate([prompt], self.params)[0].outputs[0]
        return out.timings.prefill_tokens_per_s, out.timings.decode_tokens_per_s


def llama_kv_bytes_per_token(meta: dict, per_32: int) -> int:
    """llama.cpp's KV bytes per token from a GGUF's metadata: K and V of every layer, at
    `per_32` bytes per 32 values."""
    arch = meta["general.architecture"]
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta[f"{arch}.embedding_length"]) // heads
    k_dim = int(meta.get(f"{arch}.attention.key_length", head_dim))
    v_dim = int(meta.get(f"{arch}.attention.value_length", head_dim))
    return int(meta[f"{arch}.block_count"]) * kv_heads * (k_dim + v_dim) * per_32 // 32


class LlamaCppContext:
    """llama.cpp at one context length, flash attention on, K and V of type LLAMA_KV[kv]."""

    def __init__(self, path: Path, ctx: int, gen: int, threads: int, kv: str):
        from llama_cpp import Llama

        self.kv_name, ggml_type, per_32 = LLAMA_KV[kv]
        self.gen = gen
        self.llm = Llama(
            str(path), n_ctx=ctx + gen + 64, n_batch=512, n_threads=threads,
            n_threads_batch=threads, flash_attn=True, type_k=ggml_type, type_v=ggml_type,
            verbose=False,
        )  # fmt: skip
        self.kv_bytes_per_token = llama_kv_bytes_per_token(self.llm.metadata, per_32)

    def run(self, prompt: list[int]) -> tuple[float, float]:
        self.llm.reset()
        start = time.perf_counter()
        first = None
        for n, _ in enumerate(self.llm.generate(list(prompt), temp=0.0, top_k=1, reset=True), 1):
            if first is None:
                first = time.perf_counter()
            if n == self.gen:
                break
        end = time.perf_counter()
        return len(prompt) / (first - start), (self.gen - 1) / (end - first)


def llama_cpp_installed() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def context_rows(
    path: Path,
    contexts: list[int],
    *,
    runs: int,
    gen: int,
    threads: int,
    kv_dtypes: list[str],
    dtype: str = "float32",
    llama_cpp: bool = True,
    log: Callable[[str], None] = lambda _: None,
) -> list[dict]:
    """One row per (context, engine): {engine, kv, context, prompt_tokens, prefill_tok_s,
    decode_tok_s, kv_bytes_per_token}. Every engine of a context length is loaded, then
    they take turns run by run; llama.cpp (when `llama_cpp` and installed) runs once per
    distinct llama.cpp KV type of kv_dtypes, on a .gguf file only."""
    from tokenmill.loader import open_checkpoint

    config = open_checkpoint(path).config
    use_llama = llama_cpp and path.suffix == ".gguf" and llama_cpp_installed()
    rows = []
    for ctx in contexts:
        engines: list[tuple[str, object]] = []
        for kv in kv_dtypes:
            log(f"context {ctx}: loading tokenmill, {kv} KV cache")
            engines.append(("tokenmill", TokenmillContext(path, ctx, gen, threads, kv, dtype)))
        if use_llama:
            for name in dict.fromkeys(LLAMA_KV[kv][0] for kv in kv_dtypes):
                kv = next(k for k in kv_dtypes if LLAMA_KV[k][0] == name)
                log(f"context {ctx}: loading llama.cpp, {name} KV cache, flash attention")
                engines.append(("llama.cpp", LlamaCppContext(path, ctx, gen, threads, kv)))
        rates: list[list[tuple[float, float]]] = [[] for _ in engines]
        window, vocab = config.max_position, config.vocab_size
        prompts = [prompt_for(ctx, gen, window, i, vocab) for i in range(1, runs + 1)]
        # the warm-up, not counted: a short prompt runs every code path once (a whole
        # 8,192-token one would cost as much as a timed run)
        warm = prompt_for(min(ctx, 128), gen, window, 0, vocab)
        for _, engine in engines:
            engine.run(warm)
        for prompt in prompts:
            for j, (_, engine) in enumerate(engines):
                rates[j].append(engine.run(prompt))
        for (name, engine), got in zip(engines, rates, strict=True):
            rows.append(
                {
                    "engine": name,
                    "kv": engine.kv_name,
                    "context": ctx,
                    "prompt_tokens": len(prompts[0]),
                    "prefill_tok_s": statistics.median(r[0] for r in got),
                    "decode_tok_s": statistics.median(r[1] for r in got),
                    "kv_bytes_per_token": engine.kv_bytes_per_token,
                }
            )
            log(
                f"context {ctx}: {name} {engine.kv_name}: prefill {rows[-1]['prefill_tok_s']:.0f} "
                f"tok/s, decode {rows[-1]['decode_tok_s']:.1f} tok/s"
            )
        del engines
    return rows


def markdown_table(rows: list[dict]) -> str:
    """The rows as a Markdown table; a tokenmill row's last column is its prefill and
    decode speed over llama.cpp's at the same context (llama.cpp's row of the same KV
    type where there is one, else its first)."""
    lines = [
        "| context | engine | KV | KV bytes/token | prefill tok/s | decode tok/s | vs llama.cpp |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        context = str(r["context"])
        if r["prompt_tokens"] != r["context"]:
            context += f" ({r['prompt_tokens']} + gen)"
        peers = [p for p in rows if p["engine"] == "llama.cpp" and p["context"] == r["context"]]
        peer = next((p for p in peers if p["kv"] == r["kv"]), peers[0] if peers else None)
        ratio, kv_bytes = "-", f"{r['kv_bytes_per_token']:,}"
        if r["engine"] == "tokenmill" and peer is not None:
            ratio = (
                f"{r['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x / "
                f"{r['decode_tok_s'] / peer['decode_tok_s']:.2f}x"
            )
            if peer["kv"] == r["kv"]:  # the target: within 5% of llama.cpp's bytes
                share = r["kv_bytes_per_token"] / peer["kv_bytes_per_token"]
                kv_bytes += f" ({share:.2f}x llama.cpp's, {'within' if abs(share - 1) <= 0.05 else 'beyond'} 5%)"
        lines.append(
            f"| {context} | {r['engine']} | {r['kv']} | {kv_bytes} | "
            f"{r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | {ratio} |"
        )
    return "\n".join(lines)


def cmd_context(args, path: Path, threads: int, log: Callable[[str], None]) -> dict:
    """`tokenmill bench --context`: the rows and their table (printed), as a report."""
    peers = getattr(args, "peers", None)
    with_llama = peers is None or "llamacpp" in peers
    if with_llama and not llama_cpp_installed():
        log("llama.cpp: not installed (pip install llama-cpp-python); tokenmill alone")
    kv = getattr(args, "kv_cache_dtype", "auto")
    rows = context_rows(
        path, args.context, runs=args.runs, gen=args.gen_len, threads=threads,
        kv_dtypes=[kv], dtype=args.dtype, llama_cpp=with_llama, log=log,
    )  # fmt: skip
    print(markdown_table(rows))
    return {
        "context": rows,
        "settings": {"runs": args.runs, "gen_len": args.gen_len, "threads": threads, "kv": kv},
    }
