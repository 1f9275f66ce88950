"""`tokenmill bench`: how fast tokenmill runs a model, next to its peers and the machine's limits.

Everything is measured in one invocation, on the same weights and the same token ids:

  latency     batch 1: a fixed prompt of exactly P tokens (P = 128 and 512) and G = 128
              greedy tokens with EOS ignored. Time to first token (TTFT), prefill tokens/s
              (P / TTFT) and decode tokens/s ((G - 1) / (last token - first token)); the
              median of --runs runs after one warm-up run per P.
  throughput  N requests (64) with prompt and output lengths drawn from a fixed seed
              (32-512 and 32-256 tokens, random token ids, EOS ignored), all submitted at
              once, as vLLM's benchmark_throughput does: requested output tokens per second
              of wall time, and prompt + output tokens per second.
  machine     memory read bandwidth over a buffer far larger than the last-level cache and
              over a buffer the size of each engine's weights, copy bandwidth, fp32/bf16
              GEMM throughput. An engine's batch-1 decode ceiling is read bandwidth / the
              bytes one decode step reads of its weights.

Each engine runs in its own subprocess (so its peak RSS is its own), loaded once and kept
alive while the parent sends it one command at a time. The latency runs of all engines
are interleaved round by round, so a burst of load from other processes on a shared
machine hits every engine alike instead of whichever was running.

    tokenmill   python -m tokenmill.bench SPEC          (TokenmillRunner below)
    peers       python benchmarks/peers.py ENGINE SPEC  (transformers, llama.cpp)

SPEC is the workload as JSON (`Workload`). A worker loads the model and replies with its
facts (load_s, decode_bytes_per_token, kv_pool_bytes, notes), then answers each command
on stdin (`latency P`, `throughput`, `exit`) with one line `@@bench <json>` on stdout;
every other line it prints is log text. Workers report raw times: every figure is
derived here, in one place.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Peer name -> (module to import, pip packages that provide it).
PEERS: dict[str, tuple[str, list[str]]] = {
    "transformers": ("transformers", ["transformers", "accelerate"]),
    "llamacpp": ("llama_cpp", ["llama-cpp-python"]),
}
PEERS_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers.py"
# Native code, minus ggml's AMX kernels: they segfault in ggml_backend_amx_mul_mat on
# Sapphire Rapids VMs (llama.cpp issue 20824). The -mno-amx flags are no-ops elsewhere.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CPP_CMAKE_ARGS = f"-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='{_NO_AMX}' -DCMAKE_CXX_FLAGS='{_NO_AMX}'"
WARMUP_REQUESTS, WARMUP_TOKENS = 8, 8  # throughput warm-up: a few short requests
REPLY = "@@bench "  # a worker's reply line starts with this
PHASES = ("latency", "throughput")

# The latency prompt: this text, tokenized and repeated to exactly P tokens.
PROMPT_TEXT = (
    "The mill stood where the river bent twice before the town. Every morning the miller "
    "opened the sluice, the wheel took the water, and the stones began to turn. Farmers "
    "came with carts of wheat and rye, waited their turn by the wall, and talked about the "
    "weather, the price of salt and the new bridge that the council had promised for years. "
    "The miller weighed each sack, wrote the weight in a ledger with a blunt pencil, and "
    "kept one part in twenty as his fee. In dry summers the river ran low and the wheel "
    "turned slowly, so he ground at night when the pond behind the weir had filled again. "
)


# ---------------------------------------------------------------------- the workload


@dataclass
class Workload:
    """What every engine runs: the model, the settings and the exact token ids."""

    model: str  # a .gguf file or a checkpoint folder
    dtype: str
    threads: int
    runs: int
    gen_len: int
    latency_prompts: dict[str, list[int]]  # str(P) -> exactly P token ids
    requests: list[tuple[list[int], int]]  # (prompt token ids, output tokens)
    skip: list[str]
    kv_cache_memory: str | None
    peer_batch_size: int
    tensor_parallel_size: int = 1  # tokenmill only: its ranks (peers run on one process)
    pipeline_parallel_size: int = 1


def latency_prompt(tokenizer, length: int) -> list[int]:
    """Exactly `length` ids: the tokenizer's BOS (when it adds one), then PROMPT_TEXT repeated."""
    ids = tokenizer.encode(PROMPT_TEXT, add_special_tokens=True)
    body = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    while len(ids) < length:
        ids += body
    return ids[:length]


def random_requests(
    n: int, prompt_range: tuple[int, int], gen_range: tuple[int, int], vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs: lengths uniform in the ranges, ids uniform."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_range))]
        requests.append((prompt, rng.randint(*gen_range)))
    return requests


def build_workload(args: argparse.Namespace, path: Path, threads: int) -> Workload:
    from tokenmill.engine.llm_engine import load_tokenizer
    from tokenmill.loader import open_checkpoint

    config = open_checkpoint(path).config
    longest = max(
        max(args.prompt_len) + args.gen_len, args.request_prompt_len[1] + args.request_gen_len[1]
    )
    if longest > config.max_position:
        raise ValueError(
            f"the longest sequence ({longest} tokens) exceeds the model's context of {config.max_position}"
        )
    tokenizer = load_tokenizer(path)
    return Workload(
        model=str(path),
        dtype=args.dtype,
        threads=threads,
        runs=args.runs,
        gen_len=args.gen_len,
        latency_prompts={str(p): latency_prompt(tokenizer, p) for p in args.prompt_len},
        requests=random_requests(
            args.num_requests,
            args.request_prompt_len,
            args.request_gen_len,
            config.vocab_size,
            args.seed,
        ),
        skip=args.skip,
        kv_cache_memory=args.kv_cache_memory,
        peer_batch_size=args.peer_batch_size,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
    )


# ---------------------------------------------------------------------- the machine


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    """Shortest wall time of fn() over `repeats` calls, after one untimed call. The best run,
    as STREAM reports: other processes can only slow a run down, never speed it up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def read_bandwidth(nbytes: int, repeats: int = 10) -> float:
    """GB/s of a read-only sum over an `nbytes` float32 buffer: its sum of squares,
    torch.dot of the buffer with itself (BLAS streams it faster than torch.sum does)."""
    import torch

    buf = torch.ones(max(1, nbytes // 4))
    return buf.nbytes / _best_time(lambda: torch.dot(buf, buf), repeats) / 1e9


def copy_bandwidth(nbytes: int, repeats: int = 10) -> float:
    """GB/s of copying `nbytes` into another buffer, read and write bytes counted."""
    import torch

    src = torch.ones(max(1, nbytes // 4))
    dst = torch.empty_like(src)
    return 2 * src.nbytes / _best_time(lambda: dst.copy_(src), repeats) / 1e9


def has_native_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX-512 BF16, AMX, Arm BF16). Without
    it torch emulates a bf16 GEMM, minutes for 4096^3 and meaningless as a limit."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = {f for line in text.splitlines() if line.startswith(("flags", "Features"))
             for f in line.split(":", 1)[1].split()}  # fmt: skip
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def gemm_gflops(size: int, dtype, repeats: int = 3) -> float:
    """GFLOP/s of a size x size x size matrix product in `dtype`."""
    import torch

    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size**3 / _best_time(lambda: a @ b, repeats) / 1e9


def measure_machine(
    threads: int, buffer_mib: int, gemm_size: int, working_sets: dict[str, int]
) -> dict[str, Any]:
    """Memory bandwidth (GB/s) and GEMM throughput (GFLOP/s) with `threads` torch threads.
    working_sets: {engine: bytes a decode step reads}, read bandwidth measured at that size."""
    import torch

    torch.set_num_threads(threads)
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads,
        "read_gb_s": read_bandwidth(buffer_mib * 2**20),
        "copy_gb_s": copy_bandwidth(buffer_mib * 2**20 // 2),
        "working_set_read_gb_s": {n: read_bandwidth(b) for n, b in working_sets.items()},
        "gemm_gflop_s": {
            "float32": gemm_gflops(gemm_size, torch.float32),
            "bfloat16": gemm_gflops(gemm_size, torch.bfloat16) if has_native_bf16() else None,
        },
        "bandwidth_buffer_mib": buffer_mib,
        "gemm_size": gemm_size,
    }


# ---------------------------------------------------------------------- bytes per decode step


def gguf_decode_bytes(path: Path) -> int:
    """Bytes of a GGUF file's tensors that one decode step reads: all of them, except that a
    lookup table (token or position embedding) gives one row, unless the token embedding is
    also the (tied) un-embedding, which reads it whole."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    lookups = ["position_embd.weight"]
    if "output.weight" in tensors:
        lookups.append("token_embd.weight")
    for name in lookups:
        if name in tensors:
            t = tensors[name]
            rows = int(t.shape[-1])  # GGUF lists dims fastest first: [d, rows]
            total -= int(t.n_bytes) - int(t.n_bytes) // rows
    return total


def _storages(model) -> list[tuple[str, int]]:
    """(dtype, bytes) of each distinct storage behind a torch model's state dict (tied
    weights share one)."""
    found = {}
    for tensor in model.state_dict().values():
        storage = tensor.untyped_storage()
        found[storage.data_ptr()] = (str(tensor.dtype).removeprefix("torch."), storage.nbytes())
    return list(found.values())


def torch_decode_bytes(model, tied_embedding=None) -> int:
    """Bytes of a torch model's weights that one decode step reads: every tensor of its state
    dict, tied ones once, except that an `nn.Embedding` gives one row, unless it is
    `tied_embedding`, the table the un-embedding reads whole."""
    import torch

    total = sum(nbytes for _, nbytes in _storages(model))
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module is not tied_embedding:
            weight = module.weight
            total -= weight.untyped_storage().nbytes() - weight[0].nbytes
    return total


def weight_bytes_by_dtype(model) -> dict[str, int]:
    """Bytes of a torch model's state dict per dtype: how it stores its weights (float32, or
    packed uint8 codes with float16 scales...)."""
    totals: dict[str, int] = {}
    for dtype, nbytes in _storages(model):
        totals[dtype] = totals.get(dtype, 0) + nbytes
    return totals


# ---------------------------------------------------------------------- the tokenmill worker


class TokenmillRunner:
    """tokenmill in a bench worker. Prefix caching is off: every run computes its prompt."""

    def __init__(self, work: Workload):
        from tokenmill import kernels
        from tokenmill.llm import LLM

        start = time.perf_counter()
        self.llm = LLM(
            work.model,
            dtype=work.dtype,
            threads=work.threads,
            kv_cache_memory=work.kv_cache_memory,
            enable_prefix_caching=False,
            tensor_parallel_size=work.tensor_parallel_size,
            pipeline_parallel_size=work.pipeline_parallel_size,
        )
        self._ids = itertools.count()
        engine = self.llm.engine
        tied = engine.model.embed if engine.model.lm_head is None else None
        self.info = {
            "load_s": time.perf_counter() - start,
            "decode_bytes_per_token": torch_decode_bytes(engine.model, tied),
            "weight_bytes_by_dtype": weight_bytes_by_dtype(engine.model),
            "kv_pool_bytes": engine.cache.nbytes,
            "kernels": kernels.isa(),
            "notes": ["prefix caching off"],
        }
        if engine.parallel is not None:  # what each rank holds, and (per run) collectives
            self.info["parallel"] = {
                "world_size": engine.parallel.world,
                "ranks": engine.parallel_plan,
            }
            self.info["notes"].append(
                f"{engine.parallel.world} ranks: " + "; ".join(engine.parallel_plan)
            )

    def latency(self, prompt: list[int], gen_len: int) -> dict:
        from tokenmill.sampling import SamplingParams

        params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
        group = getattr(self.llm.engine.runner, "group", None)
        spent = group.collective_s if group is not None else 0.0
        t = self.llm.generate([prompt], params)[0].timings
        if t.prefill_tokens != len(prompt):
            raise RuntimeError(f"computed {t.prefill_tokens} of {len(prompt)} prompt tokens")
        out = {
            "ttft_s": t.time_to_first_token,
            "decode_s": t.total - t.time_to_first_token,
            "output_tokens": t.output_tokens,
        }
        if group is not None:  # rank 0's seconds inside collectives, per generated token
            out["collective_s_per_token"] = (group.collective_s - spent) / t.output_tokens
        return out

    def throughput(self, requests: list[tuple[list[int], int]]) -> dict:
        """A short warm-up, then every request added at once and the engine stepped until
        all finish."""
        engine = self.llm.engine
        self._run_all([(p, min(n, WARMUP_TOKENS)) for p, n in requests[:WARMUP_REQUESTS]])
        tokens, preemptions = engine.stats["generation_tokens"], engine.kv_stats()["preemptions"]
        start = time.perf_counter()
        self._run_all(requests)
        return {
            "wall_s": time.perf_counter() - start,
            "computed_output_tokens": engine.stats["generation_tokens"] - tokens,
            "mode": f"continuous batching (max_num_seqs {engine.scheduler.max_num_seqs})",
            "preemptions": engine.kv_stats()["preemptions"] - preemptions,
        }

    def _run_all(self, requests: list[tuple[list[int], int]]) -> None:
        from tokenmill.sampling import SamplingParams

        engine = self.llm.engine
        for prompt, n in requests:
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            engine.add_request(f"bench-{next(self._ids)}", prompt, params)
        while engine.has_unfinished():
            engine.step()


def peak_rss_bytes() -> int:
    """This process's peak resident memory. Linux's getrusage maxrss would carry the parent's
    RSS at fork over into a child; VmHWM belongs to the program the child exec'd."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reply(message: dict) -> None:
    print(REPLY + json.dumps(message), flush=True)


def serve(spec_path: str) -> None:
    """The tokenmill worker: load, reply with the facts, then answer commands until `exit`."""
    work = Workload(**json.loads(Path(spec_path).read_text()))
    runner = TokenmillRunner(work)
    reply(runner.info)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "latency":
            reply(runner.latency(work.latency_prompts[arg], work.gen_len))
        elif command == "throughput":
            reply(runner.throughput(work.requests))
        elif command == "exit":
            reply({"peak_rss_bytes": peak_rss_bytes()})
            return


# ---------------------------------------------------------------------- driving the workers


def log(message: str) -> None:
    print(f"tokenmill bench: {message}", file=sys.stderr, flush=True)


def resolve_peers(
    names: list[str], install: bool, model: Path
) -> tuple[list[str], dict[str, dict]]:
    """The peers to run, and {peer: skipped entry} for the others (each with a reason)."""
    run, skipped = [], {}
    for name in names:
        module, packages = PEERS[name]
        reason = None
        if name == "llamacpp" and model.suffix != ".gguf":
            reason = "llama.cpp needs a .gguf model"
        elif not PEERS_SCRIPT.exists():
            reason = f"peer runners are in benchmarks/peers.py of a source checkout ({PEERS_SCRIPT} is missing)"
        elif importlib.util.find_spec(module) is None:
            reason = (
                install_peer(name)
                if install
                else f"not installed (pip install {' '.join(packages)}, or --install-peers)"
            )
        if reason is None:
            run.append(name)
        else:
            log(f"skipping {name}: {reason}")
            skipped[name] = {"status": "skipped", "reason": reason}
    return run, skipped


def install_peer(name: str) -> str | None:
    """pip install a peer into this environment; None on success, else why it failed."""
    packages = PEERS[name][1]
    env = dict(os.environ)
    if name == "llamacpp":
        env.setdefault("CMAKE_ARGS", LLAMA_CPP_CMAKE_ARGS)
        log("installing llama-cpp-python (compiles llama.cpp: several minutes)")
        packages = ["--no-cache-dir", *packages]  # a cached wheel may lack these flags
    else:
        log(f"installing {' '.join(packages)}")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", *packages], env=env, capture_output=True, text=True
    )
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return f"pip install {' '.join(packages)} failed: {last}"


class WorkerError(RuntimeError):
    """A worker died; the message says how, with its last line of output."""


class Worker:
    """One engine's subprocess, driven one command at a time."""

    def __init__(self, name: str, spec: Path):
        if name == "tokenmill":
            cmd = [sys.executable, "-m", "tokenmill.bench", str(spec)]
        else:
            cmd = [sys.executable, str(PEERS_SCRIPT), name, str(spec)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.last_line = ""

    def read(self) -> dict:
        """The next reply; the log lines before it are echoed to stderr."""
        for line in self.proc.stdout:
            text, found, message = line.partition(REPLY)  # a progress bar may precede it
            sys.stderr.write(text if found else line)
            self.last_line = text.strip() or self.last_line
            if found:
                return json.loads(message)
        status = self.proc.wait()
        how = f"killed by {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"
        raise WorkerError(f"{how}: {self.last_line}" if self.last_line else how)

    def call(self, command: str) -> dict:
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # read() says how it died
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Engines:
    """The engines' workers, loaded one after another and measured side by side. `raw`
    collects each engine's facts and raw times; an engine whose worker dies is marked
    failed and the others go on."""

    def __init__(self, names: list[str], spec: Path):
        self.workers: dict[str, Worker] = {}
        self.raw: dict[str, dict] = {}
        for name in names:
            log(f"loading {name}")
            self.workers[name] = Worker(name, spec)
            info = self._ask(name, None)
            if info is not None:
                self.raw[name] = {"status": "ok", **info}

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc) -> None:
        for worker in self.workers.values():
            worker.close()

    def _ask(self, name: str, command: str | None) -> dict | None:
        """The worker's reply to `command` (None: its next reply), or None if it is gone."""
        worker = self.workers.get(name)
        if worker is None:
            return None
        try:
            return worker.read() if command is None else worker.call(command)
        except WorkerError as e:
            worker.close()
            del self.workers[name]
            self.raw[name] = {"status": "failed", "reason": str(e)}
            log(f"{name} failed: {e}")
            return None

    def latency(self, prompt_lens: list[str], runs: int) -> None:
        """Per P, a warm-up round and then `runs` rounds. Each round runs every engine once,
        in an order rotated from round to round."""
        for p in prompt_lens:
            for r in range(runs + 1):
                names = list(self.workers)
                k = r % max(1, len(names))
                for name in names[k:] + names[:k]:
                    sample = self._ask(name, f"latency {p}")
                    if sample is None or r == 0:
                        continue
                    self.raw[name].setdefault("latency", {}).setdefault(p, []).append(sample)
                    decode = (sample["output_tokens"] - 1) / sample["decode_s"]
                    log(
                        f"{name} P={p} run {r}/{runs}: TTFT {sample['ttft_s'] * 1e3:.0f} ms, "
                        f"decode {decode:.1f} tok/s"
                    )

    def throughput(self) -> None:
        for name in list(self.workers):
            log(f"{name}: throughput")
            result = self._ask(name, "throughput")
            if result is not None:
                self.raw[name]["throughput"] = result
                log(f"{name}: throughput took {result['wall_s']:.1f} s")

    def finish(self) -> dict[str, dict]:
        """Each worker's peak RSS, then the raw results of all engines."""
        for name in list(self.workers):
            result = self._ask(name, "exit")
            if result is not None:
                self.raw[name].update(result)
        return self.raw


# ---------------------------------------------------------------------- figures


def summarize_latency(samples: list[dict], prompt_len: int) -> dict:
    """Medians of the raw runs (TTFT in ms, prefill and decode tokens/s), and the best run
    of each, which a busy machine disturbs least."""
    ttft = [s["ttft_s"] * 1e3 for s in samples]
    prefill = [prompt_len / s["ttft_s"] for s in samples]
    decode = [(s["output_tokens"] - 1) / s["decode_s"] for s in samples]
    out = {
        "ttft_ms": statistics.median(ttft),
        "prefill_tok_s": statistics.median(prefill),
        "decode_tok_s": statistics.median(decode),
        "best": {"ttft_ms": min(ttft), "prefill_tok_s": max(prefill), "decode_tok_s": max(decode)},
        "runs": samples,
    }
    if all("collective_s_per_token" in s for s in samples):  # a parallel tokenmill run
        out["collective_ms_per_token"] = statistics.median(
            s["collective_s_per_token"] * 1e3 for s in samples
        )
    return out


def summarize_throughput(raw: dict, requests: list[tuple[list[int], int]]) -> dict:
    """Requested output tokens/s and prompt + output tokens/s over the wall time."""
    prompt = sum(len(p) for p, _ in requests)
    output = sum(n for _, n in requests)
    return {
        **raw,
        "requests": len(requests),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "output_tok_s": output / raw["wall_s"],
        "total_tok_s": (prompt + output) / raw["wall_s"],
    }


def summarize_engine(name: str, raw: dict, work: Workload, machine: dict) -> dict:
    """An engine's figures from its raw times (decode_bytes_per_token already filled in)."""
    entry = {k: v for k, v in raw.items() if k not in ("latency", "throughput")}
    per_token = raw["decode_bytes_per_token"]
    entry["decode_ceiling_tok_s"] = machine["read_gb_s"] * 1e9 / per_token
    entry["working_set_ceiling_tok_s"] = machine["working_set_read_gb_s"][name] * 1e9 / per_token
    if "latency" in raw:
        entry["latency"] = {p: summarize_latency(s, int(p)) for p, s in raw["latency"].items()}
        first = min(entry["latency"], key=int)  # the headline decode figure: shortest prompt
        entry["decode_tok_s"] = entry["latency"][first]["decode_tok_s"]
        entry["ratio_to_ceiling"] = entry["decode_tok_s"] / entry["decode_ceiling_tok_s"]
    if "throughput" in raw:
        entry["throughput"] = summarize_throughput(raw["throughput"], work.requests)
    return entry


def build_report(
    work: Workload,
    args: argparse.Namespace,
    machine: dict,
    raw: dict[str, dict],
    gguf_bytes: int | None,
) -> dict:
    """The whole report (what --json writes): machine, model, settings, engines."""
    import tokenmill

    engines = {
        name: summarize_engine(name, r, work, machine) if r["status"] == "ok" else r
        for name, r in raw.items()
    }
    base = engines.get("tokenmill", {}).get("decode_tok_s")
    for entry in engines.values():
        if "decode_tok_s" in entry:
            entry["ratio_to_tokenmill"] = entry["decode_tok_s"] / base if base else None
    path = Path(work.model)
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return {
        "tokenmill_version": tokenmill.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "model": {
            "path": str(path),
            "file_bytes": sum(f.stat().st_size for f in files),
            "gguf_decode_bytes_per_token": gguf_bytes,
            "gguf_decode_ceiling_tok_s": machine["read_gb_s"] * 1e9 / gguf_bytes
            if gguf_bytes
            else None,
        },
        "settings": {
            "dtype": work.dtype,
            "threads": work.threads,
            "runs": work.runs,
            "prompt_lens": args.prompt_len,
            "gen_len": work.gen_len,
            "num_requests": len(work.requests),
            "request_prompt_len": list(args.request_prompt_len),
            "request_gen_len": list(args.request_gen_len),
            "seed": args.seed,
            "kv_cache_memory": work.kv_cache_memory,
            "peer_batch_size": work.peer_batch_size,
            "skip": work.skip,
        },
        "engines": engines,
    }


# ---------------------------------------------------------------------- output


def _fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:,.{digits}f}{suffix}"


def render(report: dict):
    """The report as rich renderables: the table, then the machine, the model and the notes."""
    from rich.console import Group
    from rich.text import Text

    lines = [_machine_line(report["machine"]), _model_line(report["model"])]
    for name, e in report["engines"].items():
        lines.append(
            _engine_note(name, e)
            if e["status"] == "ok"
            else f"{name}: {e['status']}: {e['reason']}"
        )
    return Group(_results_table(report), *(Text(line) for line in lines))


def _results_table(report: dict):
    from rich.table import Table

    lens = [str(p) for p in report["settings"]["prompt_lens"]]
    n = report["settings"]["num_requests"]
    title = f"tokenmill bench: {Path(report['model']['path']).name}, {report['settings']['dtype']}"
    table = Table(title=title)
    columns = ["engine", "kernels"]
    columns += [*(f"TTFT ms @{p}" for p in lens), *(f"prefill tok/s @{p}" for p in lens)]
    columns += ["decode tok/s", "ceiling tok/s", "vs ceiling"]
    columns += ["vs tokenmill", f"throughput tok/s ({n} req)", "peak RSS MiB"]
    table.add_column(columns[0], no_wrap=True)
    for column in columns[1:]:
        table.add_column(column, justify="right")
    for name, e in report["engines"].items():
        if e["status"] != "ok":
            continue
        lat = e.get("latency", {})
        table.add_row(
            name,
            e.get("kernels", "-"),
            *(_fmt(lat[p]["ttft_ms"], 0) if p in lat else "-" for p in lens),
            *(_fmt(lat[p]["prefill_tok_s"]) if p in lat else "-" for p in lens),
            _fmt(e.get("decode_tok_s")),
            _fmt(e["decode_ceiling_tok_s"]),
            _fmt(e.get("ratio_to_ceiling"), 2, "x"),
            _fmt(e.get("ratio_to_tokenmill"), 2, "x"),
            _fmt(e["throughput"]["output_tok_s"]) if "throughput" in e else "-",
            _fmt(e["peak_rss_bytes"] / 2**20, 0),
        )
    return table


def _machine_line(m: dict) -> str:
    bf = m["gemm_gflop_s"]["bfloat16"]
    bf16 = "bf16 not measured (no native bf16)" if bf is None else f"bf16 {bf:.0f} GFLOP/s"
    working_sets = ", ".join(f"{n} {v:.1f}" for n, v in m["working_set_read_gb_s"].items())
    return (
        f"machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads; memory read "
        f"{m['read_gb_s']:.1f} GB/s ({m['bandwidth_buffer_mib']} MiB buffer), copy "
        f"{m['copy_gb_s']:.1f} GB/s, read at each engine's working set: {working_sets} GB/s; "
        f"GEMM {m['gemm_size']}^3 fp32 {m['gemm_gflop_s']['float32']:.0f} GFLOP/s, "
        f"{bf16}; load average "
        f"{m['load_average_before'][0]:.1f} before, {m['load_average_after'][0]:.1f} after"
    )


def _model_line(model: dict) -> str:
    line = f"model file {model['file_bytes'] / 2**20:.1f} MiB"
    if model["gguf_decode_bytes_per_token"]:
        line += (
            f"; a decode step reads {model['gguf_decode_bytes_per_token'] / 2**20:.1f} MiB of "
            f"its tensors as stored (DRAM ceiling {model['gguf_decode_ceiling_tok_s']:.0f} tok/s)"
        )
    return line


def _engine_note(name: str, e: dict) -> str:
    parts = [
        f"load {e['load_s']:.1f} s",
        f"reads {e['decode_bytes_per_token'] / 2**20:.1f} MiB/token",
        f"working-set ceiling {e['working_set_ceiling_tok_s']:.1f} tok/s",
    ]
    coll = [
        f"@{p} {lat['collective_ms_per_token']:.2f} ms"
        for p, lat in e.get("latency", {}).items()
        if "collective_ms_per_token" in lat
    ]
    if coll:  # a parallel run: rank 0's time inside collectives per generated token
        parts.append("collectives per token " + ", ".join(coll))
    if "weight_bytes_by_dtype" in e:
        stored = ", ".join(
            f"{d} {b / 2**20:.1f} MiB" for d, b in e["weight_bytes_by_dtype"].items()
        )
        parts.append(f"weights {stored}")
    if e.get("kv_pool_bytes") is not None:
        parts.append(f"KV pool {e['kv_pool_bytes'] / 2**20:.0f} MiB")
    if "throughput" in e:
        t = e["throughput"]
        parts.append(
            f"throughput: {t['mode']}, {t['wall_s']:.1f} s, {t['total_tok_s']:.1f} prompt+output tok/s"
        )
    return f"{name}: " + "; ".join(parts + e.get("notes", []))


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            "--plot needs matplotlib: pip install matplotlib (or pip install -e '.[bench]')"
        )


def write_plot(report: dict, path: str) -> None:
    """A PNG with three bar charts: decode (with each engine's ceiling), prefill, throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = {n: e for n, e in report["engines"].items() if e["status"] == "ok"}
    names = list(engines)
    x = range(len(names))
    fig, (dec, pre, thr) = plt.subplots(1, 3, figsize=(15, 4.5))
    decode = [e.get("decode_tok_s") or 0 for e in engines.values()]
    ceilings = [e["decode_ceiling_tok_s"] for e in engines.values()]
    dec.bar_label(dec.bar(x, decode, label="measured"), fmt="%.1f", label_type="center")
    dec.scatter(x, ceilings, marker="_", s=800, color="red", label="ceiling")
    dec.set_ylim(0, 1.3 * max(decode + ceilings))
    dec.set_title("batch-1 decode tok/s")
    dec.legend(loc="upper center", ncols=2)
    lens = [str(p) for p in report["settings"]["prompt_lens"]]
    width = 0.8 / len(lens)
    for i, p in enumerate(lens):
        values = [e.get("latency", {}).get(p, {}).get("prefill_tok_s", 0) for e in engines.values()]
        bars = pre.bar([j + i * width for j in x], values, width, label=f"P={p}")
        pre.bar_label(bars, fmt="%.0f")
    pre.set_title("batch-1 prefill tok/s")
    pre.legend()
    bars = thr.bar(x, [e.get("throughput", {}).get("output_tok_s", 0) for e in engines.values()])
    thr.bar_label(bars, fmt="%.1f")
    thr.set_title(f"output tok/s, {report['settings']['num_requests']} requests")
    for ax in (dec, pre, thr):
        ax.set_xticks([j + (0.4 - width / 2 if ax is pre else 0) for j in x], names)
    fig.suptitle(
        f"{Path(report['model']['path']).name}, {report['settings']['dtype']}, {report['machine']['cpu']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------- the command


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _int_range(text: str) -> tuple[int, int]:
    values = _int_list(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX, got {text!r}")
    return values[0], values[1]


def _peer_list(text: str) -> list[str]:
    if text == "none":
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown peer {unknown[0]!r} (known: {', '.join(PEERS)}, or none)"
        )
    return names


def register(subparsers, add_model_args, add_sampling_args) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure latency and throughput next to transformers, llama.cpp and the machine's limits",
    )
    add_model_args(p)
    p.add_argument(
        "--runs", type=int, default=5, help="timed latency runs per prompt length (median)"
    )
    p.add_argument(
        "--prompt-len",
        type=_int_list,
        default=[128, 512],
        help="latency prompt lengths, e.g. 128,512",
    )
    p.add_argument("--gen-len", type=int, default=128, help="tokens generated per latency run")
    p.add_argument(
        "--num-requests", type=int, default=64, help="throughput requests, all submitted at once"
    )
    p.add_argument(
        "--request-prompt-len",
        type=_int_range,
        default=(32, 512),
        help="throughput prompt lengths MIN,MAX",
    )
    p.add_argument(
        "--request-gen-len",
        type=_int_range,
        default=(32, 256),
        help="throughput output lengths MIN,MAX",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the throughput requests")
    p.add_argument(
        "--peers",
        type=_peer_list,
        default=list(PEERS),
        help="transformers,llamacpp (default) or none",
    )
    p.add_argument("--install-peers", action="store_true", help="pip install missing peers first")
    p.add_argument(
        "--peer-batch-size",
        type=int,
        default=64,
        help="transformers: requests per generate() batch",
    )
    p.add_argument(
        "--skip", action="append", choices=PHASES, default=[], help="skip a phase (repeatable)"
    )
    p.add_argument(
        "--bandwidth-mib", type=int, default=2048, help="buffer size of the bandwidth test"
    )
    p.add_argument("--gemm-size", type=int, default=4096, help="N of the N x N x N GEMM test")
    p.add_argument("--json", default=None, metavar="PATH", help="write the full report as JSON")
    p.add_argument(
        "--plot", default=None, metavar="PATH", help="write a PNG bar chart (needs matplotlib)"
    )
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> None:
    from rich.console import Console

    from tokenmill.engine.llm_engine import resolve_model

    if args.device != "cpu":
        raise ValueError("tokenmill bench measures CPU inference; --device must be cpu")
    if min(args.runs, args.num_requests, args.peer_batch_size) < 1 or args.gen_len < 2:
        raise ValueError(
            "--runs, --num-requests and --peer-batch-size must be >= 1, --gen-len >= 2"
        )
    if args.plot:
        require_matplotlib()
    path = resolve_model(args.model)
    threads = args.threads or os.cpu_count() or 1
    work = build_workload(args, path, threads)
    gguf_bytes = gguf_decode_bytes(path) if path.suffix == ".gguf" else None
    peers, skipped = resolve_peers(args.peers, args.install_peers, path)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-") as tmp:
        spec = Path(tmp) / "workload.json"
        spec.write_text(json.dumps(asdict(work)))
        with Engines(["tokenmill", *peers], spec) as engines:
            for result in engines.raw.values():
                if result["status"] == "ok":  # no bytes reported: the GGUF tensors as stored
                    result["decode_bytes_per_token"] = (
                        result["decode_bytes_per_token"] or gguf_bytes
                    )
            log("measuring memory bandwidth and GEMM throughput")
            working_sets = {
                n: r["decode_bytes_per_token"]
                for n, r in engines.raw.items()
                if r["status"] == "ok"
            }
            machine = measure_machine(threads, args.bandwidth_mib, args.gemm_size, working_sets)
            if "latency" not in work.skip:
                engines.latency(list(work.latency_prompts), work.runs)
            if "throughput" not in work.skip:
                engines.throughput()
            raw = {**engines.finish(), **skipped}
    machine["load_average_before"], machine["load_average_after"] = load_before, os.getloadavg()
    report = build_report(work, args, machine, raw, gguf_bytes)
    Console(width=max(Console().width, 160)).print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        log(f"report written to {args.json}")
    if args.plot:
        write_plot(report, args.plot)
        log(f"chart written to {args.plot}")


if __name__ == "__main__":
    serve(*sys.argv[1:])
