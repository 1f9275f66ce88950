"""`tokenmill bench`: how fast tokenmill runs a model, next to its peers and the machine's limits.

Everything is measured in one invocation, on the same weights and the same token ids:

  latency     batch 1: a fixed prompt of exactly P tokens (P = 128 and 512) and G = 128
              greedy tokens with EOS ignored. Time to first token (TTFT), prefill tokens/s
              (P / TTFT) and decode tokens/s ((G - 1) / (last token - first token)); the
              median of --runs runs after one warm-up run per P, shown with the lowest and
              highest run, and a warning when those are more than 2x apart.
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

    tokenmill   python -m tokenmill.bench SPEC              (worker.py)
    peers       python -m tokenmill.bench.peers ENGINE SPEC (peers.py: transformers, llama.cpp)

SPEC is the workload as JSON (`Workload`). A worker loads the model and replies with its
facts (load_s, decode_bytes_per_token, kv_pool_bytes, batching, notes), then answers each
command on stdin (`latency P`, `calibrate`, `throughput`, `exit`) with one line
`@@bench <json>` on stdout; every other line it prints is log text. Workers report raw
times: every figure is derived here, in one place.

Before the timed runs, each engine's first runs (a warm-up and a timed run at the first
P, and a calibration batch of short requests) price the rest of the run (estimate.py):
"this will take about N minutes more; --quick takes about M in all". A progress bar
counts the rest in those estimated seconds. --quick is a preset of smaller sizes
(protocol.PRESETS: one P, 2 runs, 8 requests...) with only the peers already installed:
a few minutes on 2 cores.


The package, a module per part:

    protocol.py  the workload, the reply line and the peak-RSS probe (torch-free: the
                 llama.cpp runner imports it without loading torch)
    machine.py   memory bandwidth, GEMM throughput, bytes a decode step reads
    worker.py    the tokenmill worker
    peers.py     the transformers and llama.cpp workers
    engines.py   starting the workers and driving them round by round
    estimate.py  how long the rest of a run takes, from each engine's first runs
    progress.py  the progress bar
    report.py    figures, the table, the notes, the plot
    command.py   `tokenmill bench`'s arguments, --quick and the whole run
    embeddings.py  --embeddings: inputs/s of LLM.embed beside llama.cpp's embedding mode
                 (its own workers, driven as engines.Worker drives the others)
    context.py   --context: prefill and decode tok/s after each context length beside
                 llama.cpp (flash attention, the same KV type), KV bytes per token; in
                 this process, the engines taking turns run by run (benchmarks/context.py
                 runs it for several KV dtypes)
"""

from tokenmill.bench.command import build_workload, cmd_bench, register
from tokenmill.bench.engines import Engines, Worker, WorkerError, resolve_peers
from tokenmill.bench.machine import (
    gguf_decode_bytes,
    has_native_bf16,
    measure_machine,
    torch_decode_bytes,
    weight_bytes_by_dtype,
)
from tokenmill.bench.protocol import PEERS, Workload, peak_rss_bytes, reply
from tokenmill.bench.report import build_report, render, write_plot

__all__ = [
    "Engines", "PEERS", "Worker", "WorkerError", "Workload", "build_report", "build_workload",
    "cmd_bench", "gguf_decode_bytes", "has_native_bf16", "measure_machine", "peak_rss_bytes",
    "register", "render", "reply", "resolve_peers", "torch_decode_bytes",
    "weight_bytes_by_dtype", "write_plot",
]  # fmt: skip
