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

Memory (--memory): after the speed rows, each (context, engine) runs once more in a fresh
Python process of its own (memory_child, this file loaded by path, so that llama.cpp's
process never imports tokenmill or torch): it loads the engine as the speed rows do, runs
one prompt of that context (prefill, then the `gen` decoded tokens) and reports:

  peak_rss        the process's peak resident memory, load and run (VmHWM; ru_maxrss where
                  /proc has none). rss_after_load is VmRSS once the engine is loaded (the
                  KV pool resident: tokenmill's make_resident, llama.cpp's buffer clear);
                  run_peak_rss the peak of the run alone (VmHWM reset by /proc/self/
                  clear_refs after the load; None where that is refused).
  weights_bytes   the same figure for both engines: the GGUF file's tensor bytes (for a
                  checkpoint folder, tokenmill's own state dict). An engine that holds its
                  weights in more bytes than the file (a repacked or dequantized copy, or
                  the file's mmap pages beside a copy) pays that as memory beyond them.
                  engine_weights_bytes is what each engine says it holds (tokenmill: its
                  state dict's storages; llama.cpp: llama_model_size).
  kv_bytes        the KV cache as allocated, at each engine's bytes per token: tokenmill's
                  pool of kv_cache_memory = ctx + gen + 64 tokens (rounded down to whole
                  16-token blocks: capacity_tokens), llama.cpp's n_ctx = ctx + gen + 64 (as
                  llama_n_ctx reports it, after any padding). kv_used_bytes is what the
                  prompt and the generated tokens fill: bytes per token x (prompt + gen).
  beyond_bytes    peak_rss - weights_bytes - kv_bytes: what the issue's target compares
                  ("peak memory beyond the weights and the cache: <= 1.2x llama.cpp's").
                  It counts the interpreter, the engine's libraries (torch; libllama and
                  numpy), activations and other temporaries of prefill and decode, logits,
                  and load-time copies, for both engines alike.
  beyond_baseline_bytes  beyond_bytes - the peak of a process that only imports the
                  engine's modules (tokenmill: torch, tokenmill's engine and its kernel
                  library; llama.cpp: llama_cpp and its library), so the fixed cost of the
                  libraries shows apart from what running the model costs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
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


def engine_kvs(kv_dtypes: list[str], use_llama: bool) -> list[tuple[str, str]]:
    """(engine, tokenmill kv dtype) per engine to run: tokenmill at each KV dtype, and
    llama.cpp once per distinct llama.cpp KV type of them (LLAMA_KV) when use_llama."""
    engines = [("tokenmill", kv) for kv in kv_dtypes]
    if use_llama:
        names = dict.fromkeys(LLAMA_KV[kv][0] for kv in kv_dtypes)
        engines += [("llama.cpp", next(k for k in kv_dtypes if LLAMA_KV[k][0] == n)) for n in names]
    return engines


def _peer(rows: list[dict], r: dict) -> dict | None:
    """llama.cpp's row beside row r: the same context, the same KV type where there is
    one, else its first."""
    peers = [p for p in rows if p["engine"] == "llama.cpp" and p["context"] == r["context"]]
    return next((p for p in peers if p["kv"] == r["kv"]), peers[0] if peers else None)


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
        for name, kv in engine_kvs(kv_dtypes, use_llama):
            if name == "tokenmill":
                log(f"context {ctx}: loading tokenmill, {kv} KV cache")
                engine = TokenmillContext(path, ctx, gen, threads, kv, dtype)
            else:
                log(
                    f"context {ctx}: loading llama.cpp, {LLAMA_KV[kv][0]} KV cache, flash attention"
                )
                engine = LlamaCppContext(path, ctx, gen, threads, kv)
            engines.append((name, engine))
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
        peer = _peer(rows, r)
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


# ---------------------------------------------------------------------- memory (--memory)

MEMORY_REPLY = "tokenmill-memory: "  # the child's one line of JSON on stdout starts so


def _status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (VmHWM, VmRSS: kB) in bytes, None without /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _peak_rss() -> int:
    """This process's peak resident bytes: VmHWM (since the last reset), else ru_maxrss."""
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _rss() -> int:
    rss = _status_bytes("VmRSS")
    return rss if rss is not None else _peak_rss()


def _reset_peak() -> bool:
    """Reset VmHWM to the present RSS (Linux 4.0+: "5" to clear_refs): False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_bytes("VmHWM") is not None


def _import_engine(engine: str) -> None:
    """The modules an engine's load imports, and its native library, and nothing more: the
    baseline process's whole work."""
    if engine == "tokenmill":
        import torch  # noqa: F401

        from tokenmill import LLM, SamplingParams, kernels  # noqa: F401
        from tokenmill.engine import llm_engine  # noqa: F401
        from tokenmill.loader import open_checkpoint  # noqa: F401

        kernels.library(quiet=True)  # dlopen, as llama_cpp's import loads libllama
    else:
        import llama_cpp  # noqa: F401


def memory_child(spec: dict) -> dict:
    """In a fresh process: load spec["engine"] as context_rows does, run one prompt of
    spec["context"] and measure (see the module docstring); spec["baseline"]: only import
    the engine's modules. The dict is also printed, on one MEMORY_REPLY line."""
    engine, ctx, gen = spec["engine"], spec["context"], spec["gen"]
    out: dict = {"engine": engine, "rss_at_start": _rss()}
    if spec.get("baseline"):
        _import_engine(engine)
        out.update(peak_rss=_peak_rss(), rss=_rss())
        print(MEMORY_REPLY + json.dumps(out), flush=True)
        return out
    path, threads, kv = Path(spec["path"]), spec["threads"], spec["kv"]
    if engine == "tokenmill":
        from tokenmill.bench.machine import weight_bytes_by_dtype

        tm = TokenmillContext(path, ctx, gen, threads, kv, spec["dtype"])
        cache = tm.llm.engine.cache
        runner: TokenmillContext | LlamaCppContext = tm
        kv_tokens, kv_bytes = cache.capacity_tokens, cache.nbytes
        engine_weights = sum(weight_bytes_by_dtype(tm.llm.engine.model).values())
    else:
        lc = LlamaCppContext(path, ctx, gen, threads, kv)
        runner = lc
        kv_tokens = int(lc.llm.n_ctx())  # llama_n_ctx: the cache's cells, after padding
        kv_bytes = kv_tokens * lc.kv_bytes_per_token
        model = getattr(lc.llm, "_model", None)
        engine_weights = int(model.size()) if hasattr(model, "size") else None
    out.update(
        kv=runner.kv_name,
        kv_bytes_per_token=runner.kv_bytes_per_token,
        kv_tokens=kv_tokens,
        kv_bytes=kv_bytes,
        engine_weights_bytes=engine_weights,
        load_peak_rss=_peak_rss(),
        rss_after_load=_rss(),
    )
    reset = _reset_peak()
    prompt = prompt_for(ctx, gen, spec["window"], 1, spec["vocab"])
    runner.run(prompt)
    run_peak = _peak_rss()
    out.update(
        prompt_tokens=len(prompt),
        gen_tokens=gen,
        kv_used_bytes=(len(prompt) + gen) * runner.kv_bytes_per_token,
        run_peak_rss=run_peak if reset else None,
        # with the reset, the whole process's peak is the larger of the two phases'
        peak_rss=max(out["load_peak_rss"], run_peak) if reset else run_peak,
        torch_imported="torch" in sys.modules,  # llama.cpp's process should carry none
    )
    print(MEMORY_REPLY + json.dumps(out), flush=True)
    return out


# the child loads this file by path, not as tokenmill.bench.context: importing the tokenmill
# package would be no cost to llama.cpp's process (it is torch-free), but this keeps both
# processes' imports the same short list of standard modules
_CHILD = (
    "import importlib.util, json, sys\n"
    "spec = importlib.util.spec_from_file_location('tokenmill_bench_context', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(mod)\n"
    "mod.memory_child(json.loads(sys.argv[2]))\n"
)


def measure_memory(spec: dict) -> dict:
    """memory_child(spec) in a fresh Python process; its reply."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, __file__, json.dumps(spec)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    for line in done.stdout.splitlines():
        if line.startswith(MEMORY_REPLY):
            return json.loads(line.removeprefix(MEMORY_REPLY))
    raise RuntimeError(
        f"the memory process of {spec['engine']} (context {spec['context']}) exited "
        f"{done.returncode} without a reply:\n{done.stderr[-4000:]}"
    )


def gguf_tensor_bytes(path: Path) -> int | None:
    """The bytes of a GGUF file's tensors (what both engines hold as weights); None for a
    checkpoint folder."""
    if path.suffix != ".gguf":
        return None
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def memory_rows(
    path: Path,
    contexts: list[int],
    *,
    gen: int,
    threads: int,
    kv_dtypes: list[str],
    dtype: str = "float32",
    llama_cpp: bool = True,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[list[dict], dict[str, dict]]:
    """(rows, baselines): one row per (context, engine) as context_rows' engines, each
    measured in a process of its own (module docstring: memory), and per engine the
    import-only baseline process's {peak_rss, rss}."""
    from tokenmill.loader import open_checkpoint

    config = open_checkpoint(path).config
    use_llama = llama_cpp and path.suffix == ".gguf" and llama_cpp_installed()
    file_weights = gguf_tensor_bytes(path)
    common = {"path": str(path), "gen": gen, "threads": threads, "dtype": dtype}
    common |= {"window": config.max_position, "vocab": config.vocab_size}
    engines = engine_kvs(kv_dtypes, use_llama)  # as context_rows
    baselines = {}
    for name in dict.fromkeys(e for e, _ in engines):
        log(f"memory: {name}'s modules alone (the baseline)")
        got = measure_memory({**common, "engine": name, "context": 0, "baseline": True})
        baselines[name] = {"peak_rss": got["peak_rss"], "rss": got["rss"]}
    rows = []
    for ctx in contexts:
        for name, kv in engines:
            log(f"memory: context {ctx}, {name}, {kv} KV cache, in a process of its own")
            got = measure_memory({**common, "engine": name, "context": ctx, "kv": kv})
            weights = file_weights if file_weights is not None else got["engine_weights_bytes"]
            beyond = got["peak_rss"] - weights - got["kv_bytes"]
            rows.append(
                {
                    "engine": name,
                    "kv": got["kv"],
                    "context": ctx,
                    "prompt_tokens": got["prompt_tokens"],
                    "gen_tokens": got["gen_tokens"],
                    "peak_rss": got["peak_rss"],
                    "load_peak_rss": got["load_peak_rss"],
                    "rss_after_load": got["rss_after_load"],
                    "run_peak_rss": got["run_peak_rss"],
                    "weights_bytes": weights,
                    "weights_source": "gguf tensors" if file_weights is not None else "engine",
                    "engine_weights_bytes": got["engine_weights_bytes"],
                    "kv_bytes": got["kv_bytes"],
                    "kv_tokens": got["kv_tokens"],
                    "kv_bytes_per_token": got["kv_bytes_per_token"],
                    "kv_used_bytes": got["kv_used_bytes"],
                    "beyond_bytes": beyond,
                    "baseline_rss": baselines[name]["peak_rss"],
                    "beyond_baseline_bytes": beyond - baselines[name]["peak_rss"],
                    "torch_imported": got["torch_imported"],
                }
            )
            log(
                f"memory: context {ctx}, {name}: peak {got['peak_rss'] / 2**20:.0f} MiB, "
                f"beyond weights and cache {beyond / 2**20:.0f} MiB"
            )
    return rows, baselines


TARGET = 1.2  # the target: peak memory beyond the weights and the cache <= 1.2x llama.cpp's


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def markdown_memory_table(rows: list[dict], baselines: dict[str, dict] | None = None) -> str:
    """The memory rows as a Markdown table, MiB; a tokenmill row's last column is its
    memory beyond weights and cache over llama.cpp's at the same context (llama.cpp's row
    of the same KV type where there is one, else its first), against the 1.2x target,
    and the same beyond each engine's import-only baseline."""
    lines = [
        "| context | engine | KV | weights | KV cache (tokens) | after load | peak (run) "
        "| beyond weights + cache | beyond baseline | vs llama.cpp |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        peer = _peer(rows, r)
        ratio = "-"
        if r["engine"] == "tokenmill" and peer is not None and peer["beyond_bytes"] > 0:
            share = r["beyond_bytes"] / peer["beyond_bytes"]
            ratio = f"{share:.2f}x ({'within' if share <= TARGET else 'beyond'} {TARGET}x)"
            if peer["beyond_baseline_bytes"] > 0:
                ratio += f"; {r['beyond_baseline_bytes'] / peer['beyond_baseline_bytes']:.2f}x beyond baselines"
        lines.append(
            f"| {r['context']} | {r['engine']} | {r['kv']} | {_mib(r['weights_bytes'])} | "
            f"{_mib(r['kv_bytes'])} ({r['kv_tokens']:,}) | {_mib(r['rss_after_load'])} | "
            f"{_mib(r['peak_rss'])} ({_mib(r['run_peak_rss'])}) | {_mib(r['beyond_bytes'])} | "
            f"{_mib(r['beyond_baseline_bytes'])} | {ratio} |"
        )
    if baselines:
        each = "; ".join(f"{name} {_mib(b['peak_rss'])} MiB" for name, b in baselines.items())
        lines += ["", f"Peak of each engine's modules alone (the baseline): {each}"]
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
    report = {
        "context": rows,
        "settings": {"runs": args.runs, "gen_len": args.gen_len, "threads": threads, "kv": kv},
    }
    if getattr(args, "memory", False):
        memory, baselines = memory_rows(
            path, args.context, gen=args.gen_len, threads=threads, kv_dtypes=[kv],
            dtype=args.dtype, llama_cpp=with_llama, log=log,
        )  # fmt: skip
        print()
        print(markdown_memory_table(memory, baselines))
        report["memory"], report["memory_baseline"] = memory, baselines
    return report
