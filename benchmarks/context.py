"""How decode and prefill speed fall as the context grows, per KV cache dtype, beside llama.cpp.

    python benchmarks/context.py [--contexts 512,2048,4096] [--runs 3] [--threads 2]
                                 [--gen 64] [--model PATH.gguf] [--json out.json]

For each context length: one prompt of that many tokens is prefilled, then `--gen` tokens
are decoded greedily; the figures are the medians over `--runs` runs (each with other
prompt tokens, and no prefix cache, so every run computes its whole prompt). tokenmill runs
with a float32 and a float16 KV cache (`kv_cache_dtype`); llama.cpp (llama-cpp-python, when
installed) with its default f16 cache and flash attention on, on the same GGUF file (the
default model's, SmolLM2-135M-Instruct Q4_1). Also printed: the KV bytes per token of each.

Both engines run in this one process, one after the other, on the same threads; run it on
a quiet machine, and say which CPU (`lscpu`) with its figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tokenmill import LLM, SamplingParams, hub


def tokenmill_rates(path, ctx: int, runs: int, gen: int, threads: int, kv: str) -> dict:
    llm = LLM(
        path,
        kv_cache_memory=f"{ctx + gen + 64}tok",
        threads=threads,
        enable_prefix_caching=False,
        kv_cache_dtype=kv,
    )
    params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    prefill, decode = [], []
    for i in range(runs):
        out = llm.generate([list(range(100 + i, 100 + i + ctx))], params)[0].outputs[0]
        prefill.append(out.timings.prefill_tokens_per_s)
        decode.append(out.timings.decode_tokens_per_s)
    return {
        "prefill_tok_s": statistics.median(prefill),
        "decode_tok_s": statistics.median(decode),
        "kv_bytes_per_token": llm.engine.cache.bytes_per_token,
    }


def llama_cpp_rates(path, ctx: int, runs: int, gen: int, threads: int) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(
        str(path), n_ctx=ctx + gen + 64, n_batch=512, n_threads=threads, flash_attn=True,
        verbose=False,
    )  # fmt: skip
    prefill, decode = [], []
    for i in range(runs):
        llm.reset()
        prompt = list(range(100 + i, 100 + i + ctx))
        start = time.perf_counter()
        first = None
        for n, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1), 1):
            if first is None:
                first = time.perf_counter()
            if n == gen:
                break
        end = time.perf_counter()
        prefill.append(ctx / (first - start))
        decode.append((gen - 1) / (end - first))
    meta = llm.metadata  # f16 K and V: 2 bytes x 2 x layers x K/V heads x head dim
    arch = meta["general.architecture"]
    heads, width = int(meta[f"{arch}.attention.head_count"]), int(meta[f"{arch}.embedding_length"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    return {
        "prefill_tok_s": statistics.median(prefill),
        "decode_tok_s": statistics.median(decode),
        "kv_bytes_per_token": 4 * int(meta[f"{arch}.block_count"]) * kv_heads * (width // heads),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="512,2048,4096")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = args.model or hub.fetch("smollm2-135m-instruct", quiet=True)
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        for name, kv in (("tokenmill f32 KV", "float32"), ("tokenmill f16 KV", "float16")):
            r = tokenmill_rates(path, ctx, args.runs, args.gen, args.threads, kv)
            rows.append({"engine": name, "context": ctx, **r})
            print(json.dumps(rows[-1]), flush=True)
        r = llama_cpp_rates(path, ctx, args.runs, args.gen, args.threads)
        if r is None:
            print("llama.cpp: not installed (pip install llama-cpp-python)", flush=True)
        else:
            rows.append({"engine": "llama.cpp f16 KV, flash attention", "context": ctx, **r})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| engine | context | prefill tok/s | decode tok/s | KV bytes/token |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        kv = r["kv_bytes_per_token"] or "-"
        print(
            f"| {r['engine']} | {r['context']} | {r['prefill_tok_s']:.0f} | "
            f"{r['decode_tok_s']:.1f} | {kv} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
